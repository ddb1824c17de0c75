"""The egress process for real: started by the node's egress supervisor through the
``direct`` supervisor as ``kibotos-egress`` in the test's host namespace, with a guest
(`netbed`) whose TCP the slot table steers to it, a real SOCKS5 server (microsocks,
checking username and password) and a DNS upstream in the test internet, and the
credentials fetched from a fake of ctrl's endpoint.

Every wait is a poll under a deadline; nothing asserts how long anything took."""

from __future__ import annotations

import os
import signal
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from egressbed import (
    UPSTREAM_ANSWER,
    DirectCounter,
    EgressNode,
    process_status,
    running,
    serve_upstream,
    socks_server,
    tcp_query,
)
from netbed import Instance, Stopper, World, network_config, resolve

from kibotos.node.egress.listeners import EgressInstance
from kibotos.node.network.policy import NetworkPolicy
from kibotos.node.network.records import NetworkRecords
from kibotos.protocol.commands.network import EgressRef, ResolverRef
from kibotos.testing.fake_credentials import FakeCredentials

pytestmark = pytest.mark.root

DEADLINE = 60.0
REVISIONS = {("corp", 1): ("alice", "s3cret"), ("corp", 2): ("alice", "wrong")}
CORP = EgressRef(name="corp", revision=1, address="socks.test:1080", authenticated=True)


async def eventually(check: Callable[[], object], what: str) -> object:
    """`check()` (run on a thread) until it is truthy, at most `DEADLINE` seconds."""
    with trio.move_on_after(DEADLINE):
        while True:
            value = await trio.to_thread.run_sync(check)
            if value:
                return value
            await trio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def fetch(instance: Instance, address: str = "198.18.0.1", port: int = 80) -> str:
    return await trio.to_thread.run_sync(lambda: instance.fetch(address, port, timeout=5))


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def records(tmp_path: Path) -> NetworkRecords:
    return NetworkRecords(tmp_path / "network")


@pytest.fixture
def ctrl():
    with FakeCredentials("node-secret", REVISIONS) as fake:
        yield fake


@pytest.fixture
def node(world: World, ctrl):
    n = EgressNode(world, ctrl.url)
    yield n
    n.close()


@pytest.fixture
def upstream(world: World):
    stopper = Stopper()
    serve_upstream(world, stopper)
    yield
    stopper.stop()


def start_instance(world: World, records: NetworkRecords, instance_id: str,
                   policy: NetworkPolicy) -> tuple[Instance, EgressInstance]:
    instance = Instance(world, records, network_config(), instance_id, policy)
    egress = EgressInstance.from_record(instance.record)
    assert egress is not None
    return instance, egress


async def test_guest_tcp_goes_through_the_socks5_server_and_never_direct(
        world, records, node, ctrl):
    counter = DirectCounter(world)
    a, egress_a = start_instance(world, records, "inst-egress",
                                 NetworkPolicy(egress=CORP, public_egress=False))
    try:
        with socks_server(world, "alice", "s3cret") as server:
            async with running(node.egress()) as egress:
                assert egress.current is None  # nothing references an Egress yet
                assert await egress.set_instance(egress_a)
                assert await fetch(a) == "198.18.0.1"
                assert await fetch(a, "2001:2::1") == "2001:2::1"
                with a.guest.socket() as conn:  # a long connection, both ways
                    conn.settimeout(10)
                    await trio.to_thread.run_sync(conn.connect, ("198.18.0.1", 7))
                    for chunk in (b"one", b"two" * 10000):
                        await trio.to_thread.run_sync(conn.sendall, chunk)
                        got = b""
                        while len(got) < len(chunk):
                            got += await trio.to_thread.run_sync(conn.recv, 65536)
                        assert got == chunk

                # the process: the egress account, no capabilities, none to gain
                (unit,) = await node.units()
                assert unit.main_pid is not None
                status = process_status(unit.main_pid)
                account = os.stat(node.socket_dir.with_name("run-egress"))
                assert status["Uid"].split() == [str(account.st_uid)] * 4
                assert account.st_uid != 0
                for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
                    assert int(status[cap], 16) == 0, cap
                assert status["NoNewPrivs"].strip() == "1"
                assert mode(node.socket_dir.with_name("run-egress")) == 0o700
                # the credentials: one root-only file per revision
                assert mode(node.credentials_dir) == 0o700
                (path,) = node.credentials_dir.iterdir()
                assert path.name == "corp@1.json"
                assert mode(path) == 0o600
                assert os.stat(path).st_uid == 0

                # a revision with a password the server refuses: connections fail,
                # and the old revision's file is gone at once
                wrong = EgressInstance(**{**egress_a.__dict__, "egress": EgressRef(
                    name="corp", revision=2, address="socks.test:1080",
                    authenticated=True)})
                assert await egress.set_instance(wrong)
                assert sorted(p.name for p in node.credentials_dir.iterdir()) == \
                    ["corp@2.json"]
                assert (await fetch(a)).startswith("failed")
                assert await egress.set_instance(egress_a)
                assert await fetch(a) == "198.18.0.1"

                server.stop()  # the SOCKS5 server down: fail, never direct
                assert (await fetch(a)).startswith("failed")
                assert (await fetch(a, "198.18.0.1", 7)).startswith("failed")
                server.start()
                assert await fetch(a) == "198.18.0.1"

                # the egress process killed: refused until the node started another
                os.kill(unit.main_pid, signal.SIGKILL)
                assert (await fetch(a)).startswith("failed")
                await eventually(lambda: egress.current is not None and
                                 egress.current.number == 2 and egress.confirmed,
                                 "generation 2")
                assert await fetch(a) == "198.18.0.1"

                # nothing references an Egress any more: the credentials go at once,
                # the process drains and ends
                assert await egress.remove_instance("inst-egress")
                assert list(node.credentials_dir.iterdir()) == []
                await eventually(lambda: egress.draining is None and
                                 egress.current is None, "the last generation to end")
                assert await node.units() == []
        assert counter.packets() == 0  # not one packet left the host directly
        assert ctrl.requests == [("corp", 1), ("corp", 2), ("corp", 1)]
    finally:
        a.close()


async def test_a_restarted_node_restores_egress_from_its_files_alone(world, records, ctrl):
    a, egress_a = start_instance(world, records, "inst-restore",
                                 NetworkPolicy(egress=CORP))
    node = EgressNode(world, ctrl.url)
    try:
        with socks_server(world):
            async with running(node.egress()) as first:
                assert await first.set_instance(egress_a)
            (unit,) = await node.units()
            # the process runs on without its node; then the node comes back, without
            # ctrl, and finds the credentials and the process as they were
            offline = EgressNode.__new__(EgressNode)
            offline.__dict__.update(node.__dict__, ctrl_url=None)
            restarted = offline.egress()
            restarted.preload([egress_a])
            async with running(restarted):
                assert restarted.adopted == 1
                assert restarted.confirmed
                assert await fetch(a) == "198.18.0.1"
                (again,) = await node.units()
                assert again.main_pid == unit.main_pid
        assert ctrl.requests == [("corp", 1)]
    finally:
        a.close()
        await node.aclose()


async def test_a_resolver_answers_through_its_upstream_direct_and_via_the_egress(
        world, records, node, upstream):
    counter = DirectCounter(world)
    direct = ResolverRef(name="corp-dns", revision=1, upstream="upstream.test:5353")
    tunnelled = ResolverRef(name="corp-dns", revision=2, upstream="198.18.1.2:5353",
                            via_egress=True)
    a, egress_a = start_instance(world, records, "inst-dns", NetworkPolicy(resolver=direct))
    b, egress_b = start_instance(world, records, "inst-dns-via",
                                 NetworkPolicy(egress=CORP, resolver=tunnelled))
    try:
        with socks_server(world):
            async with running(node.egress()) as egress:
                assert await egress.set_instance(egress_a)
                assert await egress.set_instance(egress_b)
                for guest in (a, b):
                    # UDP and TCP, both answered by the upstream (the deployment
                    # resolver would say 198.18.1.1)
                    answer = await trio.to_thread.run_sync(
                        lambda g=guest: resolve(g.guest, "files.test", g.guest.gateway))
                    assert answer == UPSTREAM_ANSWER

                    def over_tcp(g: Instance = guest) -> bytes:
                        with g.guest.socket() as conn:
                            conn.settimeout(10)
                            conn.connect((g.guest.gateway, 53))
                            return tcp_query(conn, "files.test")

                    reply = await trio.to_thread.run_sync(over_tcp)
                    assert socket.inet_ntoa(reply[-4:]) == UPSTREAM_ANSWER
                # the queries of the direct one left the host as the egress process's
                # own; those of the other went through the SOCKS5 server
                direct_packets = counter.packets("upstream")
                assert direct_packets > 0
                answer = await trio.to_thread.run_sync(
                    lambda: resolve(b.guest, "www.test", b.guest.gateway))
                assert answer == UPSTREAM_ANSWER
                assert counter.packets("upstream") == direct_packets
    finally:
        a.close()
        b.close()
