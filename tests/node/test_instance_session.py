"""The Instance commands and ``instance_state`` frames over the real control session:
`serve_node` with the ``testvmm`` backend against `FakeCtrl`."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from instance_harness import node_config, short_dir, stop_all_units, write_template
from node_helpers import Conn, FakeCtrl, store_identity, write_proc

from kibotos.node.serve import NodeRuntime, serve_node
from kibotos.node.session.control import SessionTiming
from kibotos.plugins import EXTRA_MODULES_ENV

TIMING = SessionTiming(ping_interval=0.05, backoff_initial=0.02, backoff_cap=0.1)


async def test_commands_states_and_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EXTRA_MODULES_ENV, "kibotos_testvmm")
    base = short_dir()
    proc = write_proc(base / "proc")
    seen: dict[str, Any] = {}
    done = trio.Event()
    template = write_template(base)
    config = None

    async def command(conn: Conn, cid: int, kind: str, args: dict[str, Any]
                      ) -> dict[str, Any]:
        await conn.send(type="command", id=cid, kind=kind, args=args)
        while True:
            msg = await conn.receive()
            if msg["type"] == "command_result" and msg["id"] == cid:
                return msg
            seen.setdefault("frames", []).append(msg)

    async def until_state(conn: Conn, state: str) -> dict[str, Any]:
        for msg in seen.get("frames", []):
            if msg["type"] == "instance_state" and msg["state"] == state:
                return msg
        while True:
            msg = await conn.receive()
            seen.setdefault("frames", []).append(msg)
            if msg["type"] == "instance_state" and msg["state"] == state:
                return msg

    async def script(conn: Conn) -> None:
        await conn.send(type="welcome", session_id="ses-1", drain_requested=True,
                        overcommit={"cpu": "1", "memory": "1", "serial": 1})
        args = {"instance_id": "inst-1", "workspace_id": "ws-1", "template": template,
                "cpu_millis": 1000, "memory_bytes": 128 << 20,
                "layer": {"pool_id": "pool-a", "ref": "ws-1", "capacity_bytes": 32 << 20,
                          "epoch": 1, "create": True}, "volumes": [],
                "launch": {"hostname": "h", "env": {}}}
        seen["drained"] = await command(conn, 1, "instance.create", args)
        seen["undrain"] = await command(conn, 2, "node.drain", {"requested": False})
        seen["create"] = await command(conn, 3, "instance.create", args)
        seen["running"] = await until_state(conn, "RUNNING")
        def running_report(msg: dict[str, Any]) -> bool:
            return msg["type"] == "report" and bool(msg["instances"]) and \
                msg["instances"][0]["state"] == "RUNNING"

        # A report with the Instance RUNNING (before or after the frame: two tasks).
        reports = [m for m in seen["frames"] if running_report(m)]
        while not reports:
            msg = await conn.receive()
            seen["frames"].append(msg)
            if running_report(msg):
                reports.append(msg)
        seen["report"] = reports[0]
        seen["stop"] = await command(conn, 4, "instance.stop",
                                     {"instance_id": "inst-1", "force": False,
                                      "deadline_s": 10})
        seen["destroy"] = await command(conn, 5, "instance.destroy",
                                        {"instance_id": "inst-1"})
        seen["stopped"] = await until_state(conn, "STOPPED")
        seen["bad"] = await command(conn, 6, "instance.stop", {"instance_id": "BAD"})
        done.set()
        while True:
            await conn.receive()

    try:
        with trio.fail_after(120):
            async with trio.open_nursery() as outer:
                fake = await outer.start(FakeCtrl(script).serve)
                config = node_config(base, ctrl_url=fake.ctrl_url,
                                     extra=f'[host]\nproc_root = "{proc}"\n')
                store_identity(config)
                async with trio.open_nursery() as nursery:
                    runtime: NodeRuntime = await nursery.start(
                        lambda task_status: serve_node(config, timing=TIMING,
                                                       task_status=task_status))
                    await done.wait()
                    assert runtime.instances.holdings().instance_count == 0
                    nursery.cancel_scope.cancel()
                outer.cancel_scope.cancel()
    finally:
        if config is not None:
            await stop_all_units(config)
        import shutil

        shutil.rmtree(base, ignore_errors=True)

    assert fake.conns[0].hello["report"]["instances"] == []
    assert seen["drained"]["ok"] is False
    assert seen["drained"]["error"]["code"] == "failed_precondition"
    assert "drained" in seen["drained"]["error"]["message"]
    assert seen["undrain"] == {"type": "command_result", "id": 2, "ok": True,
                               "result": {"drain_requested": False}}
    assert seen["create"]["result"] == {"accepted": True}
    states = [m["state"] for m in seen["frames"] if m["type"] == "instance_state"]
    # The stopped Instance ended; destroying it afterwards changes nothing more.
    assert states == ["CREATING", "RUNNING", "STOPPING", "STOPPED"]
    running = seen["running"]
    assert running["workspace_id"] == "ws-1"
    assert running["reason"] is None
    assert set(running["guest"]) == {"boot_id", "capabilities"}
    assert running["at"].endswith("+00:00")
    report = seen["report"]
    assert report["instance_count"] == 1
    assert report["allocated"] == {"cpu_millis": 1000, "memory_bytes": 128 << 20}
    assert report["instances"] == [{"instance_id": "inst-1", "workspace_id": "ws-1",
                                    "state": "RUNNING", "reason": None, "objects": [
                                        {"kind": "retained-layers", "pool_id": "pool-a",
                                         "object_id": "ws-1", "epoch": 1,
                                         "released_cleanly": None}]}]
    assert running["objects"] == report["instances"][0]["objects"]
    assert seen["stop"]["result"] == {"confirmed_on_disk": True}
    assert seen["destroy"]["result"] == {"destroyed": True}
    assert seen["bad"]["error"]["code"] == "invalid_argument"
