"""Egress generations with real processes across node restarts: the same build is
adopted with its connections kept; another build on the same release line takes over
the sockets while the old generation drains its connections; a second change in a row
ends the oldest (the spec's log line) so at most two run; another release line ends
the old one at once; a draining generation exits when its last connection ends.

The node's build is a test identity: the node is made to believe it would start
another build (``source_build_id``, as the data-plane tests do), while the processes
report the build they really run."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from egressbed import EgressNode, running, socks_server
from netbed import Instance, World, network_config

from kibotos._version import __version__
from kibotos.egress import wire
from kibotos.node.egress import supervisor as egress_supervisor
from kibotos.node.egress.listeners import EgressInstance, verify
from kibotos.node.egress.supervisor import ENDED, NEWER_DRAINS
from kibotos.node.network import netns as ns
from kibotos.node.network.policy import NetworkPolicy
from kibotos.node.network.records import NetworkRecords
from kibotos.protocol.commands.network import EgressRef
from kibotos.testing.fake_credentials import FakeCredentials

pytestmark = pytest.mark.root

CORP = EgressRef(name="corp", revision=1, address="198.18.1.2:1080", authenticated=True)
DEADLINE = 60.0
IP_FREEBIND = 15


class Echo:
    """A guest connection to the test host's echo service, through the egress."""

    def __init__(self, instance: Instance) -> None:
        self.sock = instance.guest.socket()
        self.sock.settimeout(10)
        self.sock.connect(("198.18.0.1", 7))

    def works(self, data: bytes = b"still here") -> bool:
        try:
            self.sock.sendall(data)
            got = b""
            while len(got) < len(data):
                chunk = self.sock.recv(4096)
                if not chunk:
                    return False
                got += chunk
            return got == data
        except OSError:
            return False

    def close(self) -> None:
        self.sock.close()


async def check(fn, *args) -> object:
    return await trio.to_thread.run_sync(fn, *args)


async def eventually(predicate, what: str) -> None:
    with trio.move_on_after(DEADLINE):
        while not predicate():
            await trio.sleep(0.1)
        return
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def setup(world: World, tmp_path: Path) -> Iterator[tuple[EgressNode, Instance,
                                                          EgressInstance]]:
    records = NetworkRecords(tmp_path / "network")
    with FakeCredentials("node-secret", {("corp", 1): ("alice", "s3cret")}) as ctrl, \
            socks_server(world):
        node = EgressNode(world, ctrl.url)
        instance = Instance(world, records, network_config(), "inst-gen",
                            NetworkPolicy(egress=CORP))
        egress = EgressInstance.from_record(instance.record)
        assert egress is not None
        try:
            yield node, instance, egress
        finally:
            instance.close()
            node.close()


async def unit_numbers(node: EgressNode) -> list[int]:
    return sorted(int(u.name.rsplit("-", 1)[1]) for u in await node.units())


async def status(node: EgressNode, generation: int) -> dict:
    egress_dir = wire.socket_dir_of(node.socket_dir)
    return (await wire.call(wire.control_path(egress_dir, generation),
                            {"type": "status"})).body


def node_as_build(monkeypatch: pytest.MonkeyPatch, build: str) -> None:
    monkeypatch.setattr(egress_supervisor, "source_build_id", lambda: build)


async def test_two_build_changes_in_a_row_keep_at_most_two_generations(
        setup, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="kibotos.node")
    node, instance, egress_instance = setup
    async with running(node.egress()) as first:
        assert await first.set_instance(egress_instance)
    one = await check(Echo, instance)
    assert await check(one.works)

    # the same build: adopted, the connection is not touched
    same = node.egress()
    same.preload([egress_instance])
    async with running(same):
        assert same.adopted == 1
        assert await unit_numbers(node) == [1]
        assert await check(one.works)

    # another build on the same release line: generation 2 takes the sockets, 1 drains
    node_as_build(monkeypatch, f"{__version__}+build-b")
    second = node.egress()
    second.preload([egress_instance])
    async with running(second):
        assert second.current is not None
        assert second.current.number == 2
        assert await unit_numbers(node) == [1, 2]
        old = await status(node, 1)
        assert old["draining"] is True
        assert old["sockets"] == {}  # it accepts nothing new
        assert old["credentials"] == 0  # and holds no secret any more
        assert old["tunnels"] == 1
        assert (await status(node, 2))["credentials"] == 1
        assert (await status(node, 2))["sockets"] == {"inst-gen": ["tcp4", "tcp6"]}
        assert await check(one.works)  # the draining generation keeps it
        two = await check(Echo, instance)  # a new one goes through generation 2
        assert await check(two.works)
        assert (await status(node, 2))["tunnels"] == 1

    # a second change while 1 still drains: the oldest ends, at most two run
    node_as_build(monkeypatch, f"{__version__}+build-c")
    third = node.egress()
    third.preload([egress_instance])
    async with running(third):
        assert third.current is not None
        assert third.current.number == 3
        assert await unit_numbers(node) == [2, 3]
        ended = [r.getMessage() for r in caplog.records if r.getMessage().startswith(ENDED)]
        assert any("generation=1 " in line and f'reason="{NEWER_DRAINS}"' in line
                   for line in ended), ended
        assert not await check(one.works)  # its connections dropped at once
        assert await check(two.works)  # generation 2 drains and keeps this one
        assert (await status(node, 2))["draining"] is True
        three = await check(Echo, instance)
        assert await check(three.works)

        # the last connection of the draining generation ends: it exits by itself
        await check(two.close)
        await eventually(lambda: third.draining is None, "generation 2 to end")
        assert await unit_numbers(node) == [3]
        assert await check(three.works)
        await check(three.close)
    await check(one.close)


async def test_another_release_line_ends_the_old_generation_at_once(setup, monkeypatch,
                                                                   caplog):
    caplog.set_level(logging.INFO, logger="kibotos.node")
    node, instance, egress_instance = setup
    async with running(node.egress()) as first:
        assert await first.set_instance(egress_instance)
    one = await check(Echo, instance)
    assert await check(one.works)
    node_as_build(monkeypatch, "9.9.9+another-line")
    later = node.egress()
    later.preload([egress_instance])
    async with running(later):
        assert later.current is not None
        assert later.current.number == 2
        assert later.draining is None
        assert await unit_numbers(node) == [2]
        assert "reason=\"another release line" in caplog.text
        assert not await check(one.works)
        fresh = await check(Echo, instance)  # fresh sockets for the new generation
        assert await check(fresh.works)
        await check(fresh.close)
    await check(one.close)


def test_release_lines():
    from kibotos.node.runtime.build_identity import same_release_line

    assert same_release_line("0.4.1+abc", "0.4.3+def")
    assert not same_release_line("0.4.1+abc", "0.5.0+abc")
    assert same_release_line("0.1.0.dev0+src.1", "0.1.0.dev0+src.2")
    assert not same_release_line("0.2.0a1+x", "0.2.0a2+x")
    assert not same_release_line("0.2.0a1+x", "0.2.0+x")


def test_a_socket_of_another_namespace_is_not_taken_over(setup):
    """What a generation hands back is checked before the next one gets it."""
    _, _, egress_instance = setup
    gateway, port = egress_instance.address_of("tcp4")

    def elsewhere() -> socket.socket:  # the right address, in a namespace of its own
        sock = socket.socket()
        sock.setsockopt(socket.IPPROTO_IP, IP_FREEBIND, 1)
        sock.bind((gateway, port))
        sock.listen(1)
        return sock

    with ns.in_scratch_netns(elsewhere) as sock:
        assert verify(egress_instance, "tcp4", sock) == \
            "it lives in another network namespace"
    with socket.socket() as wrong:
        wrong.bind(("127.0.0.1", 0))
        wrong.listen(1)
        assert str(verify(egress_instance, "tcp4", wrong)).startswith("bound to")
