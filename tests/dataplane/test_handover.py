"""Data-plane generations across node restarts with real processes (the ``direct``
supervisor, ``kibotos dataplane serve`` units, the real guest agent on a unix socket
and a real TCP server standing in for a server in the guest).

The node's build is the test identity: the node is made to believe it would start
another build (``source_build_id``), while the processes report the build they really
run; a build of the same version is on the same release line, ``9.9.9+…`` is not.

* Another build on the same release line: an exec session streaming output, an open
  port-forward connection and a file download in flight on generation 1 all continue
  while generation 2 takes over the listening socket, and new connections made all
  through the node's restart are accepted (none refused); generation 1 exits once its
  last connection ended, and its counts stay in the node's sum.
* Another release line: the open connection drops (after the 10 s drain) and a new
  one works on the new generation.
* A second build change while generation 1 still waits: it is ended (its connection
  drops), so at most one old generation waits.
* The new generation killed right after it received the socket
  (``dataplane.handover.after-receive``), or hung after it also took the control
  socket's path (``dataplane.serve.after-control``): the old one still accepts and
  takes the node's state, and the node's retry hands over once the failpoint is gone.
* Another listen address: the new generation binds it, the old one drains on the old.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from dp_harness import (
    FAST,
    TIMEOUT,
    WORKSPACE_ID,
    Agent,
    Node,
    Plane,
    free_port,
    hand_over,
    run_exec,
    running,
    running_agent,
    target,
)

from kibotos._version import __version__
from kibotos.core import failpoints
from kibotos.core.errors import KibotosError, Unavailable
from kibotos.dataplane.clients.client import ExecClient, Output, Started, open_exec
from kibotos.dataplane.clients.files_client import FilesClient
from kibotos.dataplane.clients.ports_client import open_port
from kibotos.dataplane.endpoints.exec_session import ExecRequest
from kibotos.dataplane.process.build import source_build_id
from kibotos.node.dataplane import supervisor as dps
from kibotos.node.dataplane.supervisor import (
    NEWER_DRAINS,
    DataplaneSupervisor,
    DataplaneTiming,
    unit_name,
)
from kibotos.testing.tcp_servers import echo, tcp_server
from kibotos.testing.waiting import wait_until

SAME_LINE = f"{__version__}+build-b"
OTHER_LINE = "9.9.9+another-line"
DOWNLOAD_SIZE = 32 << 20


def node_as_build(monkeypatch: pytest.MonkeyPatch, build: str) -> None:
    monkeypatch.setattr(dps, "source_build_id", lambda: build)


async def echoed(ex: ExecClient, data: bytes) -> bool:
    """Whether `cat` on the other end sends `data` back (False when the session ended)."""
    await ex.send_stdin(data)
    got = b""
    while len(got) < len(data):
        event = await ex.next_event()
        if event is None:
            return False
        if isinstance(event, Output):
            got += event.data
    return got == data


@asynccontextmanager
async def prober(plane: Plane) -> AsyncIterator[list[str]]:
    """New connections, one after another, for the block: each a file ``stat`` on a
    fresh connection.  Yields the list of failures (empty when none was refused)."""
    failures: list[str] = []
    client = FilesClient(plane.url, plane.credential(operations=("files",)))
    made = 0

    async def probe() -> None:
        nonlocal made
        while True:
            try:
                await client.stat("/")
            except (KibotosError, OSError) as exc:
                failures.append(repr(exc))
            made += 1
            await trio.sleep(0.02)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe)
        yield failures
        nursery.cancel_scope.cancel()
    assert made > 0


def restarted(node: Node, agent: Agent, *, listen: str | None = None,
              timing: DataplaneTiming = FAST) -> DataplaneSupervisor:
    """The node started again: it reloaded its Instance (the agent's target)."""
    dp = node.dataplane(listen=listen, timing=timing)
    dp.preload([target(agent)])
    return dp


async def dropped(ex: ExecClient) -> bool:
    """Whether the exec session no longer echoes (its connection was closed)."""
    try:
        return not await echoed(ex, b"still there?\n")
    except Unavailable:
        return True


async def test_a_build_change_hands_over_and_a_release_line_change_drops(
        node: Node, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kibotos.node")
    real_build = source_build_id()
    with running_agent(node.base) as agent:
        async with running(node.dataplane()) as first:
            await hand_over(node, first, agent)
        plane = node.plane(first)  # the node is stopped: generation 1 serves on
        payload = os.urandom(DOWNLOAD_SIZE)
        (agent.root / "big").write_bytes(payload)
        files = FilesClient(plane.url, plane.credential(operations=("files",)))
        with trio.fail_after(TIMEOUT * 2):
            async with tcp_server(echo) as port, \
                    open_port(plane.url, plane.credential(operations=("ports",)),
                              port) as forward, \
                    open_exec(plane.url, plane.credential(), ExecRequest(("cat",))) as ex, \
                    files.download("content", "/big") as download:
                assert isinstance(await ex.next_event(), Started)
                assert await echoed(ex, b"before\n")
                chunks = download.chunks()
                received = bytearray(await chunks.__anext__())  # in flight, then held
                await forward.send_all(b"ping")
                assert await forward.receive_some(4) == b"ping"

                node_as_build(monkeypatch, SAME_LINE)
                async with prober(plane) as refused:
                    async with running(restarted(node, agent)) as second:
                        assert (second.generation, second.waiting) == (2, 1)
                        assert second.confirmed
                        # New connections reach generation 2, with the state it took
                        # over; the node's sum counts both generations.
                        assert (await run_exec(plane, ["echo", "new"])).stdout == b"new\n"
                        assert "kibotos_dataplane_exec_started_total 2" in \
                            await second.metrics_text()
                    # The node is stopped again; both generations still run.
                    await trio.sleep(0.5)  # a few more probes after the restart
                assert refused == []
                assert 'action="hand over"' in caplog.text
                # Every connection made before the restart is still there.
                assert await echoed(ex, b"after\n")
                await forward.send_all(b"pong")
                assert await forward.receive_some(4) == b"pong"
                async for chunk in chunks:
                    received += chunk
                digest = "sha256:" + hashlib.sha256(payload).hexdigest()
                assert "sha256:" + hashlib.sha256(received).hexdigest() == download.sha256 \
                    == digest
                info = await second.supervisor.describe(unit_name(second.scope, 1))
                assert info is not None
                assert info.active  # generation 1 waits for its connections
                await ex.close_stdin()
                async for _ in ex.events():
                    pass
        # Generation 1's last connection ended: it exits, and the node forgets it.
        node_as_build(monkeypatch, real_build)  # what generation 2 runs: adopted
        async with running(restarted(node, agent)) as third:
            assert third.generation == 2
            assert third.adopted == 2
            await wait_until(lambda: third.waiting is None, "generation 1 to exit")
            assert await third.supervisor.describe(unit_name(third.scope, 1)) is None
            text = await third.metrics_text()
            assert "kibotos_dataplane_exec_started_total" in text
        # The node stopped again.  Across release lines: the open connection drops, a
        # new one works.
        with trio.fail_after(TIMEOUT):
            async with open_exec(plane.url, plane.credential(),
                                 ExecRequest(("cat",))) as ex:
                assert isinstance(await ex.next_event(), Started)
                node_as_build(monkeypatch, OTHER_LINE)
                async with running(restarted(node, agent)) as fourth:
                    assert (fourth.generation, fourth.waiting) == (3, None)
                    assert 'reason="another release line' in caplog.text
                    assert await dropped(ex)
                    result = await run_exec(plane, ["echo", "reconnected"])
                    assert result.stdout == b"reconnected\n"
                    units = await fourth.units()
                    assert [u.name for u in units if u.active] == [
                        unit_name(fourth.scope, 3)]


@pytest.mark.parametrize("failpoint", [
    "dataplane.handover.after-receive=kill",  # it holds a copy of the listening socket
    "dataplane.serve.after-control=stop",  # it also took control.sock's path, then hung
])
async def test_a_new_generation_that_dies_in_the_handover_leaves_the_old_one(
        node: Node, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        failpoint: str) -> None:
    caplog.set_level(logging.INFO, logger="kibotos.node")
    timing = dataclasses.replace(FAST, start_timeout=3.0, stop_timeout=2.0)
    with running_agent(node.base) as agent:
        async with running(node.dataplane()) as first:
            await hand_over(node, first, agent)
        plane = node.plane(first)
        with trio.fail_after(TIMEOUT):
            async with open_exec(plane.url, plane.credential(), ExecRequest(("cat",))) as ex:
                assert isinstance(await ex.next_event(), Started)
                node_as_build(monkeypatch, SAME_LINE)
                monkeypatch.setenv(failpoints.ENV, failpoint)
                async with running(restarted(node, agent, timing=timing)) as dp:
                    # The new generation died (each retry dies too while the failpoint
                    # is set); generation 1 still accepts, and still takes the node's
                    # state: a new Instance is served at once.
                    assert (dp.generation, dp.waiting) == (1, None)
                    assert "data-plane handover failed" in caplog.text
                    assert (await run_exec(plane, ["echo", "still 1"])).stdout == \
                        b"still 1\n"
                    assert await echoed(ex, b"kept\n")
                    assert await dp.set_target(target(agent, "inst-2", WORKSPACE_ID))
                    assert dp.generation == 1
                    other = plane.credential(instance_id="inst-2")
                    assert (await run_exec(plane, ["echo", "2"], credential=other)).stdout \
                        == b"2\n"
                    # Without the failpoint, the node's retry hands over.
                    monkeypatch.delenv(failpoints.ENV)
                    await wait_until(lambda: dp.generation not in (None, 1)
                                     and dp.waiting == 1 and dp.confirmed,
                                     "a later generation to take over")
                    assert (await run_exec(plane, ["echo", "on the new one"])).stdout == \
                        b"on the new one\n"
                    assert await echoed(ex, b"still kept\n")


async def test_a_second_build_change_ends_the_waiting_generation(
        node: Node, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kibotos.node")
    with running_agent(node.base) as agent:
        async with running(node.dataplane()) as first:
            await hand_over(node, first, agent)
        plane = node.plane(first)
        with trio.fail_after(TIMEOUT):
            async with open_exec(plane.url, plane.credential(), ExecRequest(("cat",))) as on_1:
                assert isinstance(await on_1.next_event(), Started)
                node_as_build(monkeypatch, SAME_LINE)
                async with running(restarted(node, agent)) as second:
                    assert (second.generation, second.waiting) == (2, 1)
                async with open_exec(plane.url, plane.credential(),
                                     ExecRequest(("cat",))) as on_2:
                    assert isinstance(await on_2.next_event(), Started)
                    node_as_build(monkeypatch, f"{__version__}+build-c")
                    async with running(restarted(node, agent)) as third:
                        assert (third.generation, third.waiting) == (3, 2)
                        assert f'reason="{NEWER_DRAINS}"' in caplog.text
                        assert await third.supervisor.describe(
                            unit_name(third.scope, 1)) is None
                        assert await dropped(on_1)
                        assert await echoed(on_2, b"generation 2 drains\n")
                        units = await third.units()
                        assert [u.name for u in units if u.active] == [
                            unit_name(third.scope, 2), unit_name(third.scope, 3)]


async def test_a_new_listen_address_is_bound_while_the_old_one_drains(
        node: Node, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kibotos.node")
    with running_agent(node.base) as agent:
        async with running(node.dataplane()) as first:
            await hand_over(node, first, agent)
        old = node.plane(first)
        with trio.fail_after(TIMEOUT):
            async with open_exec(old.url, old.credential(), ExecRequest(("cat",))) as ex:
                assert isinstance(await ex.next_event(), Started)
                other = f"127.0.0.1:{free_port()}"
                async with running(restarted(node, agent, listen=other)) as dp:
                    assert (dp.generation, dp.waiting) == (2, 1)
                    assert "action=rebind" in caplog.text
                    new = node.plane(dp)
                    assert (await run_exec(new, ["echo", "new"])).stdout == b"new\n"
                    assert await echoed(ex, b"old one drains\n")
                    with pytest.raises(KibotosError):  # the old address accepts no more
                        await run_exec(old, ["true"])
                    await ex.close_stdin()
                    async for _ in ex.events():
                        pass
                    await wait_until(lambda: dp.waiting is None, "generation 1 to exit")

