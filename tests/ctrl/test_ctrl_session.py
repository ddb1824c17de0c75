"""The node control session against ctrl, with a trio-websocket client playing the node
(`kibotos.testing.fake_node`).

ctrl runs in-process (``inprocess_ctrl``: no socket) under the autojump clock, so the
session timeout, pings and ack timeouts pass in virtual time; the upgrade refusals and
the invalid hellos also run against hypercorn on 127.0.0.1:0 (``running_ctrl``), so the
in-process WebSocket server cannot hide what the real one does."""

from __future__ import annotations

import json

import pytest
import trio
from ctrl_helpers import RunningCtrl, error, read_node, result, wait_until
from trio_websocket import ConnectionRejected, open_websocket_url, wrap_client_stream

from kibotos.core.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from kibotos.ctrl.live.node_sessions import SessionHub
from kibotos.ctrl.live.reconcile import reconcile_once
from kibotos.ctrl.wire.base import NodeOut
from kibotos.protocol import RegistryDeleteArgs, RegistryListArgs
from kibotos.testing.clock import ThreadAwareClock
from kibotos.testing.fake_node import hello_message


def hub_of(ctrl: RunningCtrl) -> SessionHub:
    assert isinstance(ctrl.ctx.sessions, SessionHub)
    return ctrl.ctx.sessions


async def alive(ctrl: RunningCtrl, node_id: str, want: bool = True) -> None:
    async def check() -> bool:
        return bool((await read_node(ctrl.ctx.store, node_id)).session_alive) is want
    await wait_until(check, f"{node_id} session alive is {want}")


async def test_hello_welcome_and_session_facts(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    report = {"allocated": {"cpu_millis": 500, "memory_bytes": 1 << 30},
              "instance_count": 1, "volume_count": 2, "memory_tight": False,
              "memory_tight_since": None}
    async with ctrl.sim_node(cred, "node-a", 3, report=report,
                             release_version="0.1.0", source_revision="abc123") as node:
        assert node.first["type"] == "welcome"
        assert node.first["session_id"].startswith("ses-")
        assert node.first["overcommit"] == {"cpu": "1", "memory": "1", "serial": 0}
        # ctrl measures the clock and fetches a usage sample at session start.
        await node.wait_for("clock_probe")
        await node.wait_for("usage_request")

        async def measured() -> bool:
            got = await ctrl.node("node-a")
            return got["latest_session"]["clock"] is not None and got["host_usage"] is not None
        await wait_until(measured, "clock and usage stored")
        got = NodeOut.model_validate(await ctrl.node("node-a")).model_dump()
        session = got["latest_session"]
        assert session["incarnation"] == 3
        assert session["session_id"] == node.first["session_id"]
        assert session["release_version"] == "0.1.0"
        assert session["source_revision"] == "abc123"
        assert session["alive"] is True
        assert abs(session["clock"]["offset_ms"]) < 5_000
        assert session["clock"]["uncertainty_ms"] >= 0
        assert session["clock"]["sync_status"] == "synchronized"
        assert got["status"] == "READY"
        assert got["resources"] == {"cpu_millis": 4000, "memory_bytes": 8 << 30}
        assert got["latest_report"]["instance_count"] == 1
        assert got["latest_report"]["volume_count"] == 2
        assert got["dataplane_address"] == "127.0.0.1:7500"
        assert got["host_usage"]["memory_total_bytes"] == 8 << 30
        assert got["placement"] == {"eligible": True, "reason": None}
        # Session start bumped the registration version.
        assert got["registration_version"] == 2


async def test_ping_pong(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    cred = await inprocess_ctrl.enroll("node-a")
    async with inprocess_ctrl.sim_node(cred, "node-a", 1, ping_interval=None) as node:
        await node.send({"type": "ping"})
        await node.wait_for("pong")


async def test_report_is_stored_and_bumps_the_version(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    async with ctrl.sim_node(cred, "node-a", 1):
        version = (await ctrl.node("node-a"))["registration_version"]
        async with ctrl.sim_node(cred, "node-a", 1) as node:  # replaces the first
            async def measured() -> bool:
                session = (await ctrl.node("node-a"))["latest_session"]
                return session["session_id"] == node.first["session_id"] and \
                    session["clock"] is not None
            # Until then placement names the unmeasured clock, not the tight memory.
            await wait_until(measured, "the clock measured in the new session")
            version = (await ctrl.node("node-a"))["registration_version"]
            await node.send_report(instance_count=4, volume_count=1, memory_tight=True,
                                   memory_tight_since="2026-01-01T00:00:00Z",
                                   allocated={"cpu_millis": 2000, "memory_bytes": 1 << 30})

            async def stored() -> bool:
                return (await ctrl.node("node-a"))["latest_report"]["instance_count"] == 4
            await wait_until(stored, "report stored")
            got = await ctrl.node("node-a")
            assert got["registration_version"] == version + 1
            assert got["memory_tight"] is True
            assert got["memory_tight_since"] == "2026-01-01T00:00:00.000Z"
            assert got["latest_report"]["allocated"]["cpu_millis"] == 2000
            assert got["placement"]["reason"] == "host memory tight"


async def test_an_unchanged_report_is_written_again_only_after_the_refresh(
        inprocess_ctrl: RunningCtrl, autojump_clock: ThreadAwareClock) -> None:
    """The second of two reports with the same figures writes nothing within 10 s (a
    create's RUNNING report); a changed one, or the same one after 10 s, is written."""
    from kibotos.ctrl.live.node_sessions import REPORT_REFRESH_S

    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    figures = {"instance_count": 3, "volume_count": 0,
               "allocated": {"cpu_millis": 750, "memory_bytes": 3 << 30}}
    async with ctrl.sim_node(cred, "node-a", 1) as node:
        await node.send_report(**figures)

        async def count(n: int) -> bool:
            return (await ctrl.node("node-a"))["latest_report"]["instance_count"] == n
        await wait_until(lambda: count(3), "first report stored")
        first = await ctrl.node("node-a")
        await node.send_report(**figures)
        await node.send_report(**{**figures, "instance_count": 2})  # orders the check
        await wait_until(lambda: count(2), "changed report stored")
        changed = await ctrl.node("node-a")
        # the repeat wrote nothing: one bump for the changed report only
        assert changed["registration_version"] == first["registration_version"] + 1
        await trio.sleep(REPORT_REFRESH_S + 1)
        await node.send_report(**{**figures, "instance_count": 2})
        await wait_until(
            lambda: _later(ctrl, changed["latest_report"]["at"]), "refreshed report stored")


async def _later(ctrl: RunningCtrl, at: str) -> bool:
    return str((await ctrl.node("node-a"))["latest_report"]["at"]) > at


async def test_same_incarnation_reconnect_replaces_the_session(
        inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    async with (ctrl.sim_node(cred, "node-a", 2) as first,
                ctrl.sim_node(cred, "node-a", 2) as second):
        assert second.welcomed
        with trio.fail_after(30):
            await first.closed.wait()
        assert first.close_reason == "replaced"
        got = await ctrl.node("node-a")
        assert got["latest_session"]["session_id"] == second.first["session_id"]
        assert got["latest_session"]["alive"] is True


async def test_stale_incarnation_is_rejected(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    async with ctrl.sim_node(cred, "node-a", 5):
        pass
    async with ctrl.sim_node(cred, "node-a", 4) as node:
        assert node.first["type"] == "rejected"
        assert node.first["reason"] == "stale_incarnation"
        assert "4" in node.first["message"]
        assert "5" in node.first["message"]


async def test_socket_close_ends_the_session_at_once(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    async with ctrl.sim_node(cred, "node-a", 1):
        await alive(ctrl, "node-a")
        assert hub_of(ctrl).is_alive("node-a")
    await alive(ctrl, "node-a", False)
    got = await ctrl.node("node-a")
    assert got["status"] == "OFFLINE"
    assert got["latest_session"]["ended_at"] is not None
    assert got["host_usage"] is None
    assert not hub_of(ctrl).is_alive("node-a")


async def test_silence_ends_the_session(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    """No message for session_timeout (3 s here): the session is dead."""
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    async with ctrl.sim_node(cred, "node-a", 1, ping_interval=None,
                             answer_probes=False) as node:
        with trio.fail_after(60):
            await node.closed.wait()
        await alive(ctrl, "node-a", False)


async def test_pings_keep_the_session_alive(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    async with ctrl.sim_node(cred, "node-a", 1, ping_interval=0.5,
                             answer_probes=False) as node:
        # Longer than the session timeout, measured by the server's own clock.
        await trio.sleep(ctrl.config.ctrl.session_timeout * 2)
        assert not node.closed.is_set()
        assert (await read_node(ctrl.ctx.store, "node-a")).session_alive


async def refused_upgrades(ctrl: RunningCtrl) -> None:
    await ctrl.enroll("node-a")
    operator_cred = ctrl.operator["Authorization"].removeprefix("Bearer ")
    for cred, status in [("kid-01nobody:secret", 401), ("garbage", 401),
                         (operator_cred, 403)]:
        with pytest.raises(ConnectionRejected) as info:
            async with ctrl.sim_node(cred, "node-a", 1):
                pass
        assert info.value.status_code == status
        assert info.value.body is not None
        assert "error" in json.loads(info.value.body)


async def test_refused_credentials_fail_the_upgrade(running_ctrl: RunningCtrl) -> None:
    await refused_upgrades(running_ctrl)


async def test_refused_credentials_fail_the_in_process_upgrade(
        inprocess_ctrl: RunningCtrl, autojump_clock: ThreadAwareClock) -> None:
    await refused_upgrades(inprocess_ctrl)


async def test_hello_for_another_node_is_not_admitted(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    await ctrl.enroll("node-b")
    async with ctrl.sim_node(cred, "node-b", 1) as node:
        assert node.first["reason"] == "not_admitted"
        assert "node-a" in node.first["message"]
    assert (await ctrl.node("node-b"))["latest_session"] is None


INVALID_HELLOS = [
    "not json",
    json.dumps({"type": "ping"}),
    json.dumps(hello_message("node-a", 0)),
    json.dumps({**hello_message("node-a", 1), "resources": {"cpu_millis": "lots"}}),
    # issue 16: hostile hellos are refused as invalid, never a 1011 and a traceback
    json.dumps(hello_message("node-a", 1))[:-1] + ', "facts": ' + "[" * 1000 + "]" * 1000
    + "}",
    json.dumps(hello_message("node-a", 1))[:-1] + ', "node_id": "node-a"}',
    json.dumps(hello_message("node-a", 2**70)),
    json.dumps(hello_message("node-a", 2**63 - 1)),
    json.dumps({**hello_message("node-a", 1), "resources": {"cpu_millis": 2**70,
                                                            "memory_bytes": 1 << 30}}),
    json.dumps({**hello_message("node-a", 1), "resources": {"cpu_millis": True,
                                                            "memory_bytes": 1 << 30}}),
    json.dumps({**hello_message("node-a", 1), "incarnation": "1"}),
    json.dumps({**hello_message("node-a", 1), "release_version": "0.2\x1b[31m"}),
    json.dumps({**hello_message("node-a", 1), "source_revision": "abc\ndef"}),
]


async def answer_to_first_frame(ctrl: RunningCtrl, frame: str) -> dict[str, object]:
    """Open the session endpoint by hand, send `frame` as the first frame, return the
    answer."""
    cred = await ctrl.enroll("node-a")
    headers = [(b"Authorization", f"Bearer {cred}".encode())]
    if ctrl.connect is None:
        url = ctrl.url.replace("https://", "wss://") + "/v1/node/session"
        async with open_websocket_url(url, extra_headers=headers,
                                      ssl_context=ctrl.tls) as ws:
            await ws.send_message(frame)
            with trio.fail_after(30):
                return dict(json.loads(await ws.get_message()))
    stream = await ctrl.connect()
    async with trio.open_nursery() as nursery:
        ws = await wrap_client_stream(nursery, stream, "ctrl",  # type: ignore[arg-type]
                                      "/v1/node/session", extra_headers=headers)
        await ws.send_message(frame)
        with trio.fail_after(30):
            answer = dict(json.loads(await ws.get_message()))
        await ws.aclose()
    return answer


@pytest.mark.parametrize("frame", INVALID_HELLOS)
async def test_invalid_hello(running_ctrl: RunningCtrl, frame: str) -> None:
    answer = await answer_to_first_frame(running_ctrl, frame)
    assert answer["type"] == "rejected"
    assert answer["reason"] == "invalid_hello"


@pytest.mark.parametrize("frame", INVALID_HELLOS)
async def test_invalid_hello_in_process(inprocess_ctrl: RunningCtrl,
                                        autojump_clock: ThreadAwareClock, frame: str) -> None:
    answer = await answer_to_first_frame(inprocess_ctrl, frame)
    assert answer["type"] == "rejected"
    assert answer["reason"] == "invalid_hello"


async def test_overcommit_push_and_ack(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    async with ctrl.sim_node(cred, "node-a", 1) as node:
        await alive(ctrl, "node-a")
        before = len(node.received)
        got = result(await ctrl.http.put("/v1/nodes/node-a/overcommit", headers=ctrl.operator,
                                         json={"cpu": "2.5"}))
        assert got["overcommit"]["confirmed"] is False
        push = await node.wait_for("overcommit", after=before)
        assert push["cpu"] == "2.5"
        assert push["memory"] == "1"
        assert push["serial"] == 1

        async def confirmed() -> bool:
            return bool((await ctrl.node("node-a"))["overcommit"]["confirmed"])
        await wait_until(confirmed, "overcommit confirmed")
        # A default change reaches the node too.
        before = len(node.received)
        result(await ctrl.http.put("/v1/overcommit/default", headers=ctrl.operator,
                                   json={"memory": "1.5"}))
        push = await node.wait_for("overcommit", after=before)
        assert push == {"type": "overcommit", "cpu": "2.5", "memory": "1.5", "serial": 2}
        await wait_until(confirmed, "default change confirmed")


async def test_overcommit_without_ack_closes_the_session(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    async with ctrl.sim_node(cred, "node-a", 1, ack_overcommit=False) as node:
        await alive(ctrl, "node-a")
        result(await ctrl.http.put("/v1/nodes/node-a/overcommit", headers=ctrl.operator,
                                   json={"memory": "0.5"}))
        with trio.fail_after(60):
            await node.closed.wait()
        assert node.close_reason == "overcommit_ack_timeout"
    await alive(ctrl, "node-a", False)
    assert (await ctrl.node("node-a"))["overcommit"]["confirmed"] is False
    # The next welcome carries the value, and delivering it is the confirmation.
    async with ctrl.sim_node(cred, "node-a", 1) as node:
        assert node.first["overcommit"] == {"cpu": "1", "memory": "0.5", "serial": 1}
        assert (await ctrl.node("node-a"))["overcommit"]["confirmed"] is True


async def test_clock_gate(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    async with ctrl.sim_node(cred, "node-a", 1, clock_skew=45.0) as node:
        async def over() -> bool:
            clock = (await ctrl.node("node-a"))["latest_session"]["clock"]
            return clock is not None and clock["over"] is True
        await wait_until(over, "clock over")
        got = await ctrl.node("node-a")
        assert 40_000 < got["latest_session"]["clock"]["offset_ms"] < 50_000
        assert got["placement"] == {"eligible": False, "reason": "clock offset beyond 30 s"}
        # The host's time gets fixed; the next reconciliation lifts the gate.
        node.clock_skew = 0.0
        assert await reconcile_once(hub_of(ctrl)) == 1
        got = await ctrl.node("node-a")
        assert got["latest_session"]["clock"]["over"] is False
        assert got["placement"]["eligible"] is True


async def test_reconcile_fetches_the_latest_usage(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    async with ctrl.sim_node(cred, "node-a", 1) as node:
        await node.wait_for("usage_request")
        node.sample = lambda: {"at": "2026-01-01T00:00:10Z", "memory_tight": True,
                               "cpu_idle_ratio": None}
        await reconcile_once(hub_of(ctrl))
        got = await ctrl.node("node-a")
        assert got["host_usage"] == {"at": "2026-01-01T00:00:10Z", "memory_tight": True,
                                     "cpu_idle_ratio": None}


async def test_commands_over_the_session(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    hub = hub_of(ctrl)
    cred = await ctrl.enroll("node-a")
    with pytest.raises(Unavailable):
        await hub.call("node-a", RegistryListArgs(), timeout=5)
    async with ctrl.sim_node(cred, "node-a", 1) as node:
        await alive(ctrl, "node-a")

        async def answer() -> None:
            for _ in range(2):
                before = len(node.received)
                cmd = await node.wait_for("command", after=before)
                if cmd["kind"] == "registry.list":
                    await node.send({"type": "command_result", "id": cmd["id"], "ok": True,
                                     "result": {"args": cmd["args"]}})
                else:
                    await node.send({"type": "command_result", "id": cmd["id"], "ok": False,
                                     "error": {"code": "failed_precondition",
                                               "message": "no such thing"}})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer)
            await trio.sleep(0.1)
            # registry.* are answered here: the simulated node leaves them alone.
            assert await hub.call("node-a", RegistryListArgs(limit=5), timeout=30) == {
                "args": {"limit": 5}}
            await trio.sleep(0.1)
            with pytest.raises(FailedPrecondition, match="no such thing"):
                await hub.call("node-a", RegistryDeleteArgs(instance_ids=["inst-1"]),
                               timeout=30)
        with pytest.raises(DeadlineExceeded):
            await hub.call("node-a", RegistryListArgs(), timeout=0.5)


async def test_isolate_and_the_incarnation_rules(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    isolate = {"confirm_host_cannot_write": True}
    async with ctrl.sim_node(cred, "node-a", 7):
        await alive(ctrl, "node-a")
        err = error(await ctrl.http.post("/v1/nodes/node-a/isolate", headers=ctrl.operator,
                                         json=isolate), "failed_precondition")
        assert "live control session" in err["message"]
    await alive(ctrl, "node-a", False)
    out = result(await ctrl.http.post("/v1/nodes/node-a/isolate", headers=ctrl.operator,
                                      json=isolate))
    assert out["node"]["isolated_incarnation"] == 7
    version = out["node"]["registration_version"]
    for incarnation in (7, 6):
        async with ctrl.sim_node(cred, "node-a", incarnation) as node:
            assert node.first["reason"] == "isolated"
    assert (await ctrl.node("node-a"))["status"] == "ISOLATED"
    # A restart with a new incarnation clears the isolate.
    async with ctrl.sim_node(cred, "node-a", 8) as node:
        assert node.welcomed
        got = await ctrl.node("node-a")
        assert got["isolated"] is False
        assert got["status"] == "READY"
        assert got["registration_version"] > version


async def test_retired_node_rules(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    async with ctrl.sim_node(cred, "node-a", 3):
        await alive(ctrl, "node-a")
    await alive(ctrl, "node-a", False)
    result(await ctrl.http.post("/v1/nodes/node-a/isolate", headers=ctrl.operator,
                                json={"confirm_host_cannot_write": True}))
    result(await ctrl.http.post("/v1/nodes/node-a/retire", headers=ctrl.operator, json={}))
    # The isolated incarnation still hears it was isolated; a new one is not admitted.
    async with ctrl.sim_node(cred, "node-a", 3) as node:
        assert node.first["reason"] == "isolated"
    async with ctrl.sim_node(cred, "node-a", 4) as node:
        assert node.first["reason"] == "not_admitted"
        assert "retired" in node.first["message"]
    got = await ctrl.node("node-a")
    assert got["status"] == "RETIRED"
    assert got["isolated_incarnation"] == 3


async def test_retire_closes_a_drained_nodes_session(inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    async with ctrl.sim_node(cred, "node-a", 1) as node:
        await alive(ctrl, "node-a")
        result(await ctrl.http.post("/v1/nodes/node-a/drain", headers=ctrl.operator, json={}))
        got = result(await ctrl.http.post("/v1/nodes/node-a/retire", headers=ctrl.operator,
                                          json={}))
        assert got["status"] == "RETIRED"
        with trio.fail_after(30):
            await node.closed.wait()
        assert node.close_reason == "retired"
    assert not hub_of(ctrl).is_alive("node-a")
    assert (await read_node(ctrl.ctx.store, "node-a")).session_alive is False


async def test_revoke_closes_the_session_and_keeps_the_node_out(
        inprocess_ctrl: RunningCtrl,
        autojump_clock: ThreadAwareClock) -> None:
    ctrl = inprocess_ctrl
    cred = await ctrl.enroll("node-a")
    async with ctrl.sim_node(cred, "node-a", 1) as node:
        await alive(ctrl, "node-a")
        result(await ctrl.http.post("/v1/enrollment/revoke", headers=ctrl.operator,
                                    json={"id": cred.partition(":")[0]}))
        with trio.fail_after(30):
            await node.closed.wait()
        assert node.close_reason == "revoked"
    await alive(ctrl, "node-a", False)
    async with ctrl.sim_node(cred, "node-a", 2) as node:
        assert node.first["reason"] == "not_admitted"
    assert (await ctrl.node("node-a"))["status"] == "REVOKED"

