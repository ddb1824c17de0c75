"""The slot table's steering to the egress process, with real namespaces and nftables
and the node's own sockets in the Instance namespace (`listeners.open_sockets`), but no
egress process: the test accepts on the sockets itself.

With an Egress the guest's TCP arrives at the listener on the gateway, with its
original destination readable (``SO_ORIGINAL_DST``) and not one packet reaching the
internet directly; the never-reachable and denied destinations are still rejected;
nothing listening means refused, never direct.  With a Resolver the guest's DNS
arrives at the node's socket on the gateway's port 53 instead of the deployment
resolver."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from egressbed import DirectCounter
from netbed import Instance, World, dns_query, network_config, resolve

from kibotos.egress.sockets import original_destination
from kibotos.node.egress.listeners import EgressInstance, open_sockets, verify
from kibotos.node.network import enforce
from kibotos.node.network.policy import NetworkPolicy
from kibotos.node.network.records import NetworkRecords
from kibotos.protocol.commands.network import EgressRef, ResolverRef

pytestmark = pytest.mark.root

EGRESS = EgressRef(name="corp", revision=1, address="198.18.1.2:1080")
RESOLVER = ResolverRef(name="corp-dns", revision=1, upstream="198.18.1.2:5353")


@pytest.fixture
def records(tmp_path: Path) -> NetworkRecords:
    return NetworkRecords(tmp_path / "network")


@pytest.fixture
def start(world: World, records: NetworkRecords) -> Iterator:
    started: list[Instance] = []

    def start(instance_id: str, policy: NetworkPolicy) -> Instance:
        instance = Instance(world, records, network_config(), instance_id, policy)
        started.append(instance)
        return instance

    yield start
    for instance in started:
        instance.close()


def connect_from_guest(instance: Instance, address: str, port: int,
                       result: dict[str, object]) -> threading.Thread:
    def run() -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with instance.guest.socket(family) as sock:
            sock.settimeout(5)
            try:
                sock.connect((address, port))
                sock.sendall(b"hello")
                result["reply"] = sock.recv(64)
            except OSError as exc:
                result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_egress_steers_guest_tcp_to_the_listener_with_its_destination(world, start):
    counter = DirectCounter(world)
    a = start("inst-egress", NetworkPolicy(egress=EGRESS, deny_out=["198.18.1.0/24"]))
    instance = EgressInstance.from_record(a.record)
    assert instance is not None
    assert instance.roles == ["tcp4", "tcp6"]
    tcp4, tcp6 = open_sockets(instance, instance.roles)
    with tcp4, tcp6:
        assert verify(instance, "tcp4", tcp4) is None
        assert verify(instance, "tcp6", tcp6) is None
        assert verify(instance, "tcp6", tcp4) == "not a tcp6 socket"
        for listener, (address, port) in ((tcp4, ("198.18.0.1", 80)),
                                          (tcp6, ("2001:2::1", 7))):
            listener.settimeout(5)
            result: dict[str, object] = {}
            thread = connect_from_guest(a, address, port, result)
            conn, peer = listener.accept()
            with conn:
                assert original_destination(conn) == (address, port)
                assert peer[0] in instance.guests
                assert conn.recv(64) == b"hello"
                conn.sendall(b"from the listener")
            thread.join(10)
            assert result == {"reply": b"from the listener"}
        # the lists and the never-reachable ranges still apply: rejected at once
        assert a.fetch("198.18.1.1", timeout=3) == "failed: EHOSTUNREACH"
        assert a.fetch("10.99.0.2", timeout=3) == "failed: EHOSTUNREACH"
        assert a.fetch("169.254.169.254", timeout=3) == "failed: EHOSTUNREACH"
        # the gateway itself is not redirected (nothing of the guest's listens there)
        assert a.fetch(instance.gateways[0], 8080, timeout=3).startswith("failed")
    # nothing listens any more: refused at once, and it does not go direct
    assert a.fetch("198.18.0.1", timeout=3) == "failed: ECONNREFUSED"
    assert counter.packets() == 0
    # the Instance's UDP still follows public_egress (the deployment resolver answers)
    assert resolve(a.guest, "www.test", a.guest.gateway) == "198.18.0.1"
    # at a node start the steering table is read back as the node's own and rewritten
    uplink = enforce.uplink_addresses(a.config, world.host)
    adoption = enforce.adopt(a.records, a.record, a.config, uplink)
    assert adoption.report.refusals == ()
    assert adoption.rewritten


def test_a_guest_cannot_reach_the_listener_without_the_redirect(world, start):
    a = start("inst-direct-port", NetworkPolicy(egress=EGRESS))
    instance = EgressInstance.from_record(a.record)
    assert instance is not None
    socks = open_sockets(instance, ["tcp4"])
    with socks[0]:
        assert a.fetch(instance.gateways[0], 15001, timeout=3) == "failed: EHOSTUNREACH"


def test_resolver_steers_guest_dns_to_the_gateway_socket(world, start):
    counter = DirectCounter(world)
    a = start("inst-resolver", NetworkPolicy(resolver=RESOLVER))
    instance = EgressInstance.from_record(a.record)
    assert instance is not None
    assert instance.roles == ["dns-udp4", "dns-udp6", "dns-tcp4", "dns-tcp6"]
    udp4, udp6, tcp4, tcp6 = open_sockets(instance, instance.roles)
    with udp4, udp6, tcp4, tcp6:
        udp4.settimeout(5)
        with a.guest.socket(socket.AF_INET, socket.SOCK_DGRAM) as guest:
            guest.settimeout(5)
            guest.sendto(dns_query("files.test"), (a.guest.gateway, 53))
            query, peer = udp4.recvfrom(512)
            assert query == dns_query("files.test")
            assert peer[0] == a.guest.address
            udp4.sendto(b"answer", peer)
            assert guest.recv(64) == b"answer"
        tcp4.settimeout(5)
        result: dict[str, object] = {}
        thread = connect_from_guest(a, a.guest.gateway, 53, result)
        conn, _ = tcp4.accept()
        with conn:
            assert conn.recv(64) == b"hello"
            conn.sendall(b"tcp answer")
        thread.join(10)
        assert result == {"reply": b"tcp answer"}
    # the deployment resolver never saw the query; without the sockets there is no
    # answer at all (no fallback to the deployment resolver)
    with pytest.raises(TimeoutError):  # (an unconnected UDP socket hears no ICMP error)
        resolve(a.guest, "files.test", a.guest.gateway, timeout=2)
    assert counter.packets() == 0
    # TCP of a Resolver-only Workspace is not steered: it goes out as public egress
    assert a.fetch("198.18.0.1") == "198.18.0.1"
