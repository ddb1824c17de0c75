"""The control session client against `FakeCtrl`, a WebSocket server playing ctrl."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from node_helpers import (
    CREDENTIAL,
    Conn,
    FakeCtrl,
    RecordingInstances,
    node_config,
    store_identity,
    write_proc,
)

from kibotos.core.errors import FailedPrecondition
from kibotos.node.host.clock import SYNCHRONIZED, UNKNOWN, UNSYNCHRONIZED, NodeClock
from kibotos.node.host.usage import UsageSampler
from kibotos.node.instances.contract import Holdings
from kibotos.node.session.control import ControlSession, NodeIsolated, SessionTiming, session_url
from kibotos.node.session.report import ReportBoard

FAST = SessionTiming(ping_interval=0.05, silence_timeout=30.0, welcome_timeout=30.0,
                     slow_retry=60.0, backoff_initial=0.02, backoff_cap=0.1)


def make_session(tmp_path: Path, ctrl_url: str, *, timing: SessionTiming = FAST,
                 instances: RecordingInstances | None = None, incarnation: int = 4,
                 skew: float | None = None) -> ControlSession:
    skew_file = tmp_path / "skew"
    if skew is not None:
        skew_file.write_text(str(skew))
    config = node_config(tmp_path, ctrl_url=ctrl_url, skew_file=skew_file)
    identity = store_identity(config)
    manager = instances or RecordingInstances()
    sampler = UsageSampler(config.host.proc_root, manager)
    return ControlSession(config, identity, incarnation,
                          clock=NodeClock(config.testing.clock_skew_file),
                          sampler=sampler, board=ReportBoard(manager, sampler.tightness),
                          instances=manager, timing=timing)


def test_session_url() -> None:
    assert session_url("http://h:7400") == "ws://h:7400/v1/node/session"
    assert session_url("https://ctrl.example/base/") == "wss://ctrl.example/base/v1/node/session"


@asynccontextmanager
async def running(session: ControlSession) -> AsyncIterator[None]:
    """Run the session in its own scope, cancelled before FakeCtrl goes away, so the
    close handshake finds ctrl still there."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.run)
        yield
        nursery.cancel_scope.cancel()


async def test_hello_welcome_and_overcommit_ack(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}
    acked = trio.Event()

    async def script(conn: Conn) -> None:
        await conn.send(type="welcome", session_id="ses-1",
                        overcommit={"cpu": "2.5", "memory": "0.9", "serial": 11})
        seen["ack"] = await conn.receive()
        await conn.send(type="overcommit", cpu="4", memory="1", serial=12)
        seen["ack2"] = await conn.receive()
        acked.set()
        while True:
            await conn.receive()

    holdings = Holdings(allocated_cpu_millis=1500, allocated_memory_bytes=2**30,
                        instance_count=2, volume_count=3)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            fake = await nursery.start(FakeCtrl(script).serve)
            session = make_session(tmp_path, fake.ctrl_url,
                                   instances=RecordingInstances(holdings))
            async with running(session):
                await acked.wait()
                conn = fake.conns[0]
                assert session.status.connected
                assert session.status.session_id == "ses-1"
            nursery.cancel_scope.cancel()

    assert conn.authorization == f"Bearer {CREDENTIAL}"
    hello = conn.hello
    assert hello["type"] == "hello"
    assert hello["node_id"] == "node-a"
    assert hello["incarnation"] == 4
    assert hello["release_version"] == "unreleased"
    assert isinstance(hello["source_revision"], str)
    assert hello["resources"] == {"cpu_millis": 2500, "memory_bytes": 4 * 2**30}
    assert hello["report"] == {"allocated": {"cpu_millis": 1500, "memory_bytes": 2**30},
                               "instance_count": 2, "volume_count": 3, "instances": [],
                               "memory_tight": False, "memory_tight_since": None}
    assert hello["dataplane_address"] == "https://127.0.0.1:7500"
    assert hello["facts"]["pools"] == [{"id": "pool-a", "shared": False, "default": True}]
    assert seen["ack"] == {"type": "overcommit_ack", "serial": 11}
    assert seen["ack2"] == {"type": "overcommit_ack", "serial": 12}
    assert session.status.overcommit == {"cpu": "4", "memory": "1", "serial": 12}


async def test_clock_usage_ping_and_commands(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}
    done = trio.Event()

    async def script(conn: Conn) -> None:
        await conn.send(type="welcome", session_id="ses-1")
        seen["ping"] = await conn.receive(skip=())  # the first frame after welcome: a ping
        before = time.time()
        await conn.send(type="clock_probe", id=7)
        seen["clock"] = await conn.receive_type("clock_reply")
        seen["clock_window"] = (before, time.time())
        await conn.send(type="usage_request", id="u1")  # not an integer ID: ignored
        await conn.send(type="usage_request", id=2)
        seen["usage"] = await conn.receive_type("usage")
        await conn.send(type="command", id=11, kind="no-such-thing", args={})
        seen["unknown"] = await conn.receive_type("command_result")
        await conn.send(type="command", id=12, kind="echo", args={"x": 1})
        seen["echo"] = await conn.receive_type("command_result")
        await conn.send(type="command", id=13, kind="refuse", args={})
        seen["refuse"] = await conn.receive_type("command_result")
        await conn.send(type="command", id=14, kind="echo", args=["x"])
        seen["malformed"] = await conn.receive_type("command_result")
        await conn.send(type="something_new", id=1)  # ignored, session stays
        await conn.send(type="clock_probe", id=8)
        seen["clock2"] = await conn.receive_type("clock_reply")
        done.set()
        while True:
            await conn.receive()

    async def echo(args: dict[str, Any]) -> dict[str, Any]:
        return {"echo": args}

    async def refuse(args: dict[str, Any]) -> dict[str, Any]:
        raise FailedPrecondition("node is draining")

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            fake = await nursery.start(FakeCtrl(script).serve)
            session = make_session(tmp_path, fake.ctrl_url, skew=100.0)
            session.commands.update(echo=echo, refuse=refuse)
            async with running(session):
                await done.wait()
                assert fake.attempts == 1
            nursery.cancel_scope.cancel()

    assert seen["ping"] == {"type": "ping"}
    clock = seen["clock"]
    assert clock["id"] == 7
    low, high = seen["clock_window"]
    assert low + 100 <= clock["node_time"] <= high + 100
    assert clock["sync_status"] in (SYNCHRONIZED, UNSYNCHRONIZED, UNKNOWN)
    assert seen["clock2"]["id"] == 8
    usage = seen["usage"]
    assert usage["id"] == 2
    assert usage["sample"]["memory_total_bytes"] == 8_000_000 * 1024
    assert usage["sample"]["memory_available_bytes"] == 6_000_000 * 1024
    assert usage["sample"]["vm_cpu_cores"] is None
    assert seen["unknown"]["id"] == 11
    assert seen["unknown"]["ok"] is False
    assert seen["unknown"]["error"]["code"] == "invalid_argument"
    assert "no-such-thing" in seen["unknown"]["error"]["message"]
    assert seen["echo"] == {"type": "command_result", "id": 12, "ok": True,
                            "result": {"echo": {"x": 1}}}
    assert seen["refuse"]["ok"] is False
    assert seen["refuse"]["error"] == {"code": "failed_precondition",
                                       "message": "node is draining"}
    assert seen["malformed"]["id"] == 14
    assert seen["malformed"]["error"]["code"] == "invalid_argument"
    assert "args: Input should be a valid dictionary" in seen["malformed"]["error"]["message"]


async def test_reconnects_after_a_drop_with_a_new_session(tmp_path: Path) -> None:
    async def script(conn: Conn) -> None:
        await conn.send(type="welcome", session_id=f"ses-{conn.number}")
        if conn.number < 3:
            await conn.ws.aclose()  # ctrl restarts, the network blips...
            return
        while True:
            await conn.receive()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            fake = await nursery.start(FakeCtrl(script).serve)
            session = make_session(tmp_path, fake.ctrl_url)
            async with running(session):
                await session.status.wait_until(lambda s: s.session_id == "ses-3")
            nursery.cancel_scope.cancel()
    assert [c.hello["incarnation"] for c in fake.conns] == [4, 4, 4]
    assert session.status.established == 3


async def test_waits_for_an_unreachable_ctrl(tmp_path: Path) -> None:
    fake = FakeCtrl()
    from node_helpers import free_port

    fake.port = free_port()  # nothing listens there yet
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            session = make_session(tmp_path, fake.ctrl_url)
            async with running(session):
                # Let it fail a few times (each failure raises the backoff).
                while session.backoff.attempt < 3:
                    await trio.sleep(0.01)
                await nursery.start(fake.serve)
                await session.status.wait_until(lambda s: s.connected)
                assert session.backoff.attempt == 0  # reset by the welcome
            nursery.cancel_scope.cancel()


async def test_silent_ctrl_is_dropped(tmp_path: Path) -> None:
    async def script(conn: Conn) -> None:
        await conn.send(type="welcome", session_id=f"ses-{conn.number}")
        if conn.number == 1:
            await trio.sleep_forever()  # reads nothing, answers nothing
        while True:
            await conn.receive()

    timing = SessionTiming(ping_interval=0.05, silence_timeout=0.3, backoff_initial=0.02,
                           backoff_cap=0.1)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            fake = await nursery.start(FakeCtrl(script).serve)
            session = make_session(tmp_path, fake.ctrl_url, timing=timing)
            async with running(session):
                await session.status.wait_until(lambda s: s.session_id == "ses-2")
            nursery.cancel_scope.cancel()


async def test_isolated_destroys_instances_and_ends(tmp_path: Path) -> None:
    async def script(conn: Conn) -> None:
        await conn.send(type="rejected", reason="isolated",
                        message="incarnation 4 was isolated")
        await conn.ws.aclose()

    instances = RecordingInstances(Holdings(instance_count=2))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            fake = await nursery.start(FakeCtrl(script).serve)
            session = make_session(tmp_path, fake.ctrl_url, instances=instances)
            with pytest.raises(NodeIsolated) as info:
                await session.run()
            nursery.cancel_scope.cancel()
    assert info.value.exit_code == 75
    assert "incarnation 4" in info.value.message
    assert instances.destroyed == 1
    assert fake.attempts == 1  # it does not knock again


@pytest.mark.parametrize("refusal", ["not_admitted", "retired", "stale_incarnation",
                                     "close_revoked", "http_401"])
async def test_refusals_are_retried_slowly(tmp_path: Path, mock_clock, refusal: str) -> None:
    """With a mock clock that moves only when told: no new attempt before the 60 s slow
    retry is over, one right after."""

    async def script(conn: Conn) -> None:
        first = fake.attempts == 1
        if first and refusal == "close_revoked":
            await conn.send(type="welcome", session_id="ses-1")
            await conn.send(type="close", reason="revoked")
        elif first:
            await conn.send(type="rejected", reason=refusal, message="no")
        else:
            await conn.send(type="welcome", session_id=f"ses-{conn.number}")
            while True:
                await conn.receive()
            return
        await conn.ws.aclose()

    fake = FakeCtrl(script, reject_status=401 if refusal == "http_401" else None)
    timing = SessionTiming(ping_interval=1000.0, silence_timeout=5000.0, slow_retry=60.0,
                           backoff_initial=0.02, backoff_cap=0.1)
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        session = make_session(tmp_path, fake.ctrl_url, timing=timing)
        async with running(session):
            await session.status.wait_until(lambda s: s.last_refusal is not None)
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(59)
            await trio.testing.wait_all_tasks_blocked()
            assert fake.attempts == 1
            if refusal == "http_401":
                fake.reject_status = None
            mock_clock.jump(2)
            await fake.wait_attempts(2)
            await session.status.wait_until(lambda s: s.connected)
            assert session.status.last_refusal is None
        nursery.cancel_scope.cancel()
    assert fake.attempts == 2


async def test_report_is_sent_when_it_changes(tmp_path: Path) -> None:
    reports: list[dict[str, Any]] = []
    got = trio.Event()

    async def script(conn: Conn) -> None:
        nonlocal got
        await conn.send(type="welcome", session_id="ses-1")
        while True:
            msg = await conn.receive_type("report")
            reports.append(msg)
            got.set()
            got = trio.Event()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            fake = await nursery.start(FakeCtrl(script).serve)
            session = make_session(tmp_path, fake.ctrl_url)
            async with running(session):
                await session.status.wait_until(lambda s: s.connected)
                proc = session.config.host.proc_root
                write_proc(proc, available_kb=500, total_kb=10000)
                _, flipped = session.sampler.sample()
                assert flipped
                session.board.mark_changed()
                await got.wait()
            nursery.cancel_scope.cancel()
    (report,) = reports
    assert report["memory_tight"] is True
    assert report["memory_tight_since"] is not None
    assert report["instance_count"] == 0
