"""What a guest reaches through its slot table, with real namespaces, veths, taps and
nftables (`netbed`): the internet and DNS by default, what its policy allows, never the
host, the management network, the metadata service or another Instance; and a policy
switch in force at once with an established connection kept."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from netbed import Instance, World, fetch, network_config, resolve

from kibotos.node.network import netns as ns
from kibotos.node.network.policy import NetworkPolicy
from kibotos.node.network.records import NetworkRecords

pytestmark = pytest.mark.root


@pytest.fixture
def records(tmp_path: Path) -> NetworkRecords:
    return NetworkRecords(tmp_path / "network")


@pytest.fixture
def start(world: World, records: NetworkRecords) -> Iterator:
    started: list[Instance] = []

    def start(instance_id: str, policy: NetworkPolicy | None = None) -> Instance:
        instance = Instance(world, records, network_config(), instance_id, policy)
        started.append(instance)
        return instance

    yield start
    for instance in started:
        instance.close()


def from_host(world: World, address: str, port: int = 80) -> str:
    return fetch(lambda f: ns.socket_in(world.host, f, socket.SOCK_STREAM), address, port)


def test_default_policy_reaches_the_internet_and_its_dns_through_the_gateway(start):
    a = start("inst-default")
    assert a.fetch("198.18.0.1") == "198.18.0.1"
    assert a.fetch("2001:2::1") == "2001:2::1"
    # the guest asks its gateway; a kernel rule sends the query to the resolver
    assert resolve(a.guest, "files.test", a.guest.gateway) == "198.18.1.1"
    assert a.fetch(resolve(a.guest, "files.test", a.guest.gateway)) == "198.18.1.1"


def test_deny_out_blocks_what_it_lists_and_nothing_else(start):
    a = start("inst-deny", NetworkPolicy(deny_out=["198.18.1.0/24"]))
    assert a.fetch("198.18.1.1").startswith("failed")
    assert a.fetch("198.18.1.2").startswith("failed")
    assert a.fetch("198.18.0.1") == "198.18.0.1"


def test_allow_out_of_one_address_with_deny_all_allows_that_one_only(start):
    a = start("inst-allow", NetworkPolicy(allow_out=["198.18.1.1"],
                                         deny_out=["0.0.0.0/0", "::/0"]))
    assert a.fetch("198.18.1.1") == "198.18.1.1"
    assert a.fetch("198.18.1.2").startswith("failed")
    assert a.fetch("198.18.0.1").startswith("failed")
    assert a.fetch("2001:2::1").startswith("failed")
    # DNS still works: it goes to the deployment resolver, not to the internet
    assert resolve(a.guest, "www.test", a.guest.gateway) == "198.18.0.1"


def test_no_public_egress_reaches_only_dns(start):
    a = start("inst-closed", NetworkPolicy(public_egress=False, allow_out=["198.18.1.1"]))
    assert a.fetch("198.18.1.1").startswith("failed")
    assert a.fetch("198.18.0.1").startswith("failed")
    assert resolve(a.guest, "www.test", a.guest.gateway) == "198.18.0.1"


def test_host_management_metadata_and_other_instances_are_never_reachable(world, start):
    a = start("inst-a", NetworkPolicy(allow_out=["0.0.0.0/0", "::/0"]))
    b = start("inst-b")
    rejected, dropped = "failed: EHOSTUNREACH", "failed: timeout"
    targets = {  # what, address, how it fails: rejected by the slot table at once, or
        # dropped by the host table (an address of the host nothing else names)
        "the uplink address": ("198.18.0.2", rejected),
        "another address of the host": ("198.18.5.5", dropped),
        "the host's management address": ("10.99.0.1", rejected),
        "a host in management_cidrs": ("10.99.0.2", rejected),
        "the metadata service": ("169.254.169.254", rejected),
        "the host end of the guest's own veth": (str(a.record.slot.v4.host), rejected),
        "the host end of another Instance's veth": (str(b.record.slot.v4.host), rejected),
    }
    for what, (address, failure) in targets.items():
        # each target answers the host, so a failure from the guest is the tables' doing
        assert not from_host(world, address).startswith("failed"), what
        assert a.fetch(address, timeout=3) == failure, what
    # another Instance's guest and its namespace (no route from the host leads there:
    # they fail even without the table, so there is no control to compare with)
    with b.guest.socket() as server:
        server.bind((b.guest.address, 8080))
        server.listen(1)
        assert a.fetch(b.guest.address, 8080, timeout=3).startswith("failed")
    assert a.fetch(str(b.record.slot.v4.ns), timeout=3).startswith("failed")
    # and the public internet does answer this guest
    assert a.fetch("198.18.0.1") == "198.18.0.1"


def test_a_switch_is_in_force_at_once_and_keeps_an_established_connection(start):
    a = start("inst-switch")
    with a.guest.socket() as conn:
        conn.settimeout(5)
        conn.connect(("198.18.0.1", 7))
        conn.sendall(b"before")
        assert conn.recv(64) == b"before"
        a.switch(NetworkPolicy(deny_out=["198.18.0.0/15"]))
        assert a.fetch("198.18.0.1", timeout=3).startswith("failed")
        conn.sendall(b"after")
        assert conn.recv(64) == b"after"
    a.switch(NetworkPolicy())
    assert a.fetch("198.18.0.1") == "198.18.0.1"
    assert a.record.pending_policy is None
