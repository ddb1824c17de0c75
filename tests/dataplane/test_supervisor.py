"""The node's side of the data plane with the real ``direct`` supervisor: start, hand
over state, adopt after a node restart, restart after a kill, replace a process that
cannot be adopted, and the spec's warning when the state is not taken in time."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest
import trio
from dp_harness import (
    TIMEOUT,
    WORKSPACE_ID,
    Node,
    free_port,
    hand_over,
    run_exec,
    running,
    running_agent,
    target,
)

from kibotos.dataplane.clients.client import Output, Started, open_exec
from kibotos.dataplane.endpoints.exec_session import ExecRequest
from kibotos.dataplane.process.control import control_call
from kibotos.node.dataplane import supervisor as dps
from kibotos.node.dataplane.supervisor import (
    NOT_CONFIRMED,
    DataplaneTiming,
    generation_of,
    scope_of,
    unit_name,
)
from kibotos.testing.waiting import wait_until


def test_scope_and_names() -> None:
    a, b = scope_of(Path("/run/kibotos/node")), scope_of(Path("/run/kibotos/node-2"))
    assert a != b
    assert len(a) == 8
    assert unit_name(a, 7) == f"kibotos-dataplane-{a}-7"
    assert generation_of(unit_name(a, 7), a) == 7
    assert generation_of(unit_name(a, 7) + ".service", a) == 7
    assert generation_of(unit_name(a, 7), b) is None
    assert DataplaneTiming().confirm_timeout == 5.0
    assert dps.UNIT_PROPERTIES["Slice"] == "kibotos-dataplane.slice"
    assert dps.UNIT_PROPERTIES["OOMScoreAdjust"] == -900


async def test_start_hand_over_and_exec(node: Node) -> None:
    with running_agent(node.base) as agent:
        async with running(node.dataplane()) as dp:
            assert (dp.generation, dp.starts, dp.adopted) == (1, 1, None)
            assert (node.state_dir / "dataplane-generation").read_text() == "1\n"
            info = await dp.supervisor.describe(unit_name(dp.scope, 1))
            assert info is not None
            assert info.active
            assert info.argv[-7:] == ("--listen", node.listen, "--socket-dir",
                                      str(node.socket_dir), "--generation", "1", "--plain")
            await hand_over(node, dp, agent)
            assert dp.confirmed
            assert (node.state_dir / "session-signing-public-key").read_text().strip() == \
                node.key.public_key
            result = await run_exec(node.plane(dp), ["echo", "through the unit"])
            assert result.stdout == b"through the unit\n"
            await dp.remove_target("inst-1")
            with pytest.raises(Exception, match="not served by this data plane"):
                await run_exec(node.plane(dp), ["true"])
            text = await dp.metrics_text()
            assert "kibotos_dataplane_exec_started_total 1" in text


async def test_adopted_after_a_node_restart_with_connections_unaffected(node: Node) -> None:
    with running_agent(node.base) as agent:
        async with running(node.dataplane()) as first:
            await hand_over(node, first, agent)
        # The node process is gone; the data plane is not, and keeps its state.
        pid = (await first.supervisor.describe(unit_name(first.scope, 1))).main_pid
        assert pid is not None
        plane = node.plane(first)
        assert (await run_exec(plane, ["echo", "alone"])).stdout == b"alone\n"
        with trio.fail_after(TIMEOUT):
            async with open_exec(plane.url, plane.credential(),
                                 ExecRequest(("cat",))) as ex:
                assert isinstance(await ex.next_event(), Started)
                restarted = node.dataplane()
                restarted.preload([target(agent)])  # the Instances the node reloaded
                async with running(restarted) as second:
                    assert (second.generation, second.starts, second.adopted) == (1, 0, 1)
                    assert second.public_key == node.key.public_key  # from the node's file
                    assert second.confirmed
                    info = await second.supervisor.describe(unit_name(second.scope, 1))
                    assert info is not None
                    assert info.main_pid == pid
                # The connection opened before the node restart still works.
                await ex.send_stdin(b"still here\n")
                await ex.close_stdin()
                out = b""
                async for event in ex.events():
                    if isinstance(event, Output):
                        out += event.data
                assert out == b"still here\n"


async def test_restarted_with_a_new_generation_after_a_kill(node: Node) -> None:
    with running_agent(node.base) as agent:
        async with running(node.dataplane()) as dp:
            await hand_over(node, dp, agent)
            plane = node.plane(dp)
            credential = plane.credential()
            assert (await run_exec(plane, ["true"], credential=credential)).status.exit_code \
                == 0
            await wait_until(lambda: dp.metrics.counters.get(1), "the first counters")
            info = await dp.supervisor.describe(unit_name(dp.scope, 1))
            assert info is not None
            assert info.main_pid is not None
            os.kill(info.main_pid, signal.SIGKILL)
            await wait_until(lambda: dp.generation == 2 and dp.confirmed,
                             "generation 2 to run with the state")
            assert (node.state_dir / "dataplane-generation").read_text() == "2\n"
            # The same credential works on the new process: the state was handed over.
            plane = node.plane(dp)
            assert (await run_exec(plane, ["echo", "again"], credential=credential)).stdout \
                == b"again\n"
            # Generation 1's counts stay in the sum.
            assert "kibotos_dataplane_exec_started_total 2" in await dp.metrics_text()
            assert await dp.supervisor.describe(unit_name(dp.scope, 1)) is None


async def test_a_process_of_another_listen_address_or_build_is_replaced(
        node: Node, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kibotos.node")
    async with running(node.dataplane()) as first:
        assert first.generation == 1
    other = f"127.0.0.1:{free_port()}"
    async with running(node.dataplane(listen=other)) as second:
        assert (second.generation, second.adopted) == (2, None)
    assert "reason=\"the listen address changed" in caplog.text
    async with running(node.dataplane(listen=other, tls=True)) as tls:
        assert (tls.generation, tls.adopted) == (3, None)
        status = await control_call(tls.control, {"type": "status"}, timeout=TIMEOUT)
        assert status["tls"] is True
    assert "reason=\"the listener settings changed (tls False -> True)" in caplog.text
    monkeypatch.setattr(dps, "source_build_id", lambda: "0.0.0+another")
    async with running(node.dataplane(listen=other)) as third:
        assert (third.generation, third.adopted) == (4, None)
        units = await third.supervisor.list("kibotos-dataplane-")
        assert [u.name for u in units if u.active] == [unit_name(third.scope, 4)]
    assert "reason=\"another release line" in caplog.text


async def test_state_not_taken_in_time_is_logged_and_resent(
        node: Node, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kibotos.node")
    timing = DataplaneTiming(confirm_timeout=1.0, watch_interval=0.2)
    with running_agent(node.base) as agent:
        async with running(node.dataplane(timing=timing)) as dp:
            await hand_over(node, dp, agent)
            info = await dp.supervisor.describe(unit_name(dp.scope, 1))
            assert info is not None
            assert info.main_pid is not None
            os.kill(info.main_pid, signal.SIGSTOP)
            try:
                assert await dp.set_target(target(agent, "inst-2", WORKSPACE_ID)) is False
                assert NOT_CONFIRMED in caplog.text
                assert not dp.confirmed
            finally:
                os.kill(info.main_pid, signal.SIGCONT)
            await wait_until(lambda: dp.confirmed, "the watcher's resend to be taken")
            plane = node.plane(dp)
            result = await run_exec(plane, ["echo", "2"],
                                    credential=plane.credential(instance_id="inst-2"))
            assert result.stdout == b"2\n"


async def test_a_start_that_fails_is_retried_while_the_node_serves_on(
        node: Node, caplog: pytest.LogCaptureFixture) -> None:
    import socket

    caplog.set_level(logging.INFO, logger="kibotos.node")
    host, port = node.listen.split(":")
    busy = socket.socket()
    busy.bind((host, int(port)))
    busy.listen()
    try:
        async with running(node.dataplane()) as dp:
            # run() came back although no process serves: the node goes on without exec.
            assert dp.generation is None
            assert "data-plane process did not start" in caplog.text
            assert await dp.set_public_key(node.key.public_key) is False
            busy.close()
            await wait_until(lambda: dp.generation is not None and dp.confirmed,
                             "a later generation to start once the port is free")
            assert dp.generation is not None
            assert dp.generation >= 2
            units = await dp.units()
            assert [u.name for u in units] == [unit_name(dp.scope, dp.generation)]
    finally:
        busy.close()
