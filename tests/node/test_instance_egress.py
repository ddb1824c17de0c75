"""A Workspace's Instance whose policy names an Egress or a Resolver, on a node that runs
its egress processes (node_network_harness: real namespaces, veths, taps and nftables;
the light test VMM's guest stand-in; a real SOCKS5 server, microsocks, checking
username and password; the credentials from a fake of ctrl's endpoint).

The guest's TCP to the test internet goes through the SOCKS5 server with the Egress
revision's credentials and never direct; it fails closed with the server down, with a
revision whose password the server refuses, and with the egress process killed, until
the node's supervisor starts a new one; credentials files have the spec's modes and
vanish when nothing references them.  The wiring survives a node killed at its steps.

Every wait is a poll under a deadline; nothing asserts how long anything took."""

from __future__ import annotations

import os
import pwd
import signal
import stat
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from adoption_harness import build_node, run_child
from node_network_harness import (
    CORP_REVISIONS,
    NODE_CREDENTIAL,
    THROUGH_UPSTREAM,
    UPSTREAM_ANSWER,
    Bed,
    DirectCounter,
    Stopper,
    create,
    egress_node,
    egress_units,
    guest,
    leftovers,
    network_bed,
    serve_upstream,
    socks_server,
    switch,
    through_corp,
)

from kibotos.core import failpoints
from kibotos.node.instances.contract import RUNNING
from kibotos.testing.fake_credentials import FakeCredentials

pytestmark = pytest.mark.root

ID = "inst-e1"
DEADLINE = 60.0


@pytest.fixture
async def bed() -> AsyncIterator[Bed]:
    async with network_bed("kn-egr-") as value:
        yield value


@pytest.fixture
def ctrl() -> Iterator[FakeCredentials]:
    with FakeCredentials(NODE_CREDENTIAL, CORP_REVISIONS) as fake:
        yield fake


def credentials_dir(bed: Bed) -> Path:
    return bed.base / "root" / "state" / "egress-credentials"


def stored(bed: Bed) -> list[str]:
    """The credentials files (none before the first fetch made the directory)."""
    path = credentials_dir(bed)
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


async def eventually(check: Callable[[], Any], what: str) -> Any:
    with trio.move_on_after(DEADLINE):
        while True:
            value = await check()
            if value:
                return value
            await trio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


async def reaches(node: Any, address: str = "198.18.1.1") -> bool:
    return await guest(node, ID, "fetch", address) == address


async def test_guest_tcp_goes_through_the_socks5_egress_and_fails_closed(
        bed: Bed, ctrl: FakeCredentials) -> None:
    counter = DirectCounter(bed.world)
    with socks_server(bed.world, "alice", "s3cret") as socks:
        async with egress_node(bed, ctrl.url) as (node, egress):
            assert await egress_units(bed.base) == []  # nothing references an Egress yet
            frame = await create(node, ID, through_corp())
            assert frame["state"] == RUNNING, frame
            # by name through the deployment resolver, then through the Egress
            assert await guest(node, ID, "resolve", "files.test") == "198.18.1.1"
            assert await reaches(node)
            assert await reaches(node, "2001:2::1")
            # the credentials: one root-only file per revision in a root-only directory
            assert mode(credentials_dir(bed)) == 0o700
            assert stored(bed) == ["corp@1.json"]
            assert mode(credentials_dir(bed) / "corp@1.json") == 0o600
            assert os.stat(credentials_dir(bed) / "corp@1.json").st_uid == 0
            (unit,) = await egress_units(bed.base)
            assert unit.main_pid is not None
            # as kibotos-egress, never root
            assert os.stat(f"/proc/{unit.main_pid}").st_uid == \
                pwd.getpwnam("kibotos-egress").pw_uid != 0

            # a revision whose password the server refuses: connections fail, the old
            # revision's file is gone at once; back to revision 1 (fetched again)
            assert await switch(node, through_corp(2), 2, ID) == \
                {"network_revision": 2, "changed": True}
            assert stored(bed) == ["corp@2.json"]
            assert not await reaches(node)
            await switch(node, through_corp(1), 3, ID)
            assert await reaches(node)

            socks.stop()  # the SOCKS5 server down: fail, never direct
            assert not await reaches(node)
            socks.start()
            assert await reaches(node)

            # the egress process killed: refused until the node starts the next one
            os.kill(unit.main_pid, signal.SIGKILL)
            assert (await guest(node, ID, "fetch", "198.18.1.1")).startswith("failed")
            await eventually(lambda: reaches(node), "a new egress process")
            (again,) = await egress_units(bed.base)
            assert again.name != unit.name  # the next generation
            assert counter.packets() == 0  # not one packet left the host directly

            # a switch to a policy without an Egress: direct, the credentials gone, the
            # process drains and ends by itself
            assert (await switch(node, {}, 4, ID))["changed"] is True
            assert stored(bed) == []
            assert await reaches(node)
            assert counter.packets() > 0
            await eventually(lambda: _none(egress_units(bed.base)), "the process to end")
            assert egress.supervisor.current is None

            assert await node.command("instance.destroy", {"instance_id": ID}) == \
                {"destroyed": True}
        assert leftovers(bed.base, bed.world) == []
    assert ctrl.requests == [("corp", 1), ("corp", 2), ("corp", 1)]


async def _none(units: Any) -> bool:
    return await units == []


async def test_a_resolver_answers_the_guest_through_its_upstream(
        bed: Bed, ctrl: FakeCredentials) -> None:
    stopper = Stopper()
    serve_upstream(bed.world, stopper)
    try:
        async with egress_node(bed, ctrl.url) as (node, _):
            frame = await create(node, ID, THROUGH_UPSTREAM)
            assert frame["state"] == RUNNING, frame
            # the upstream's answer, not the deployment resolver's (198.18.1.1)
            assert await guest(node, ID, "resolve", "files.test") == UPSTREAM_ANSWER
            assert await reaches(node)  # public egress: TCP goes direct
            assert stored(bed) == []  # a Resolver has no credentials
            assert await node.command("instance.destroy", {"instance_id": ID}) == \
                {"destroyed": True}
            await eventually(lambda: _none(egress_units(bed.base)), "the process to end")
        assert leftovers(bed.base, bed.world) == []
    finally:
        stopper.stop()


def test_the_wiring_steps_are_known_failpoints() -> None:
    assert {"node.network.after-egress", "node.network.after-egress-release"} <= \
        set(failpoints.KNOWN)


@pytest.mark.slow
async def test_a_node_killed_at_the_egress_steps_converges(
        bed: Bed, ctrl: FakeCredentials) -> None:
    args = build_node(bed.base, **bed.parts).create_args(
        ID, workspace_id="ws-1", network=through_corp(), network_revision=1)
    beside = ("node_network_harness", "attach_egress", ctrl.url)
    with socks_server(bed.world, "alice", "s3cret"):
        # killed after the egress process serves the Instance, before its VMM starts
        await run_child(bed.base, [("instance.create", args)], "node.network.after-egress",
                        beside=beside, **bed.parts)
        (unit,) = await egress_units(bed.base)  # it runs on without its node
        async with egress_node(bed, ctrl.url) as (node, egress):
            assert egress.supervisor.adopted is not None  # with the Instance preloaded
            assert await node.command("instance.create", args) == {"accepted": True}
            assert (await node.wait_state(ID, RUNNING, "FAILED"))["state"] == RUNNING
            assert await reaches(node)
            (again,) = await egress_units(bed.base)
            assert again.main_pid == unit.main_pid  # adopted, not started again
        assert stored(bed) == ["corp@1.json"]
        assert ctrl.requests == [("corp", 1)]  # the restarted node used the file alone

        # killed after the egress process let the Instance go, before the network goes
        destroy = {"instance_id": ID}
        await run_child(bed.base, [("instance.destroy", destroy)],
                        "node.network.after-egress-release", beside=beside, **bed.parts)
        assert stored(bed) == []
        async with egress_node(bed, ctrl.url) as (node, _):
            assert await node.command("instance.destroy", destroy) == {"destroyed": True}
            await eventually(lambda: _none(egress_units(bed.base)), "the process to end")
        assert leftovers(bed.base, bed.world) == []
        assert stored(bed) == []
    # (the node restarted after the release found the Instance in its records with no
    # credentials file, and asked ctrl once more before the repeated destroy)
