"""ctrl's side of the nodes' ended-Instance records (`kibotos.ctrl.live.registry_sweep`):
which records it may have deleted (Allocation released, no command in progress, not
the current Instance), the observed result it stores first, UNKNOWN for a record
deleted by hand, and a stuck release shown by cleanup-status.  Real ctrl and store, a
simulated node for the Workspace's lifecycle; the records are given as the node's
``registry.list`` returns them."""

from __future__ import annotations

from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

from ctrl_helpers import wait_until
from sqlalchemy.orm import Session
from ws_helpers import WsCtrl, open_ws_ctrl

from kibotos.ctrl.live.registry_sweep import store_results
from kibotos.ctrl.store.models import Workspace
from kibotos.ctrl.wire.workspaces import CleanupStatusOut
from kibotos.protocol import InstanceState
from kibotos.testing.clock import ThreadAwareClock

ITEMS = ("RUNTIME", "VOLUME_ATTACHMENT", "RESIDUAL")
OBSERVED = "2026-01-02T03:04:05.678901+00:00"


def entry(instance_id: str, state: str = "STOPPED", **cleanup: Any) -> dict[str, Any]:
    return {"instance_id": instance_id, "workspace_id": "ws-x", "state": state,
            "confirmed_on_disk": True, "ended_at": OBSERVED,
            "cleanup": {**dict.fromkeys(ITEMS, "RELEASED"), "observed_at": OBSERVED,
                        **cleanup}}


async def status(ctrl: WsCtrl, wid: str) -> dict[str, Any]:
    got = dict(await ctrl.call("GET", f"/v1/workspaces/{wid}/cleanup-status"))
    CleanupStatusOut.model_validate(got)
    return got


def items(got: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    return {i["item"]: (i["status"], i["source"], i["observed_at"]) for i in got["items"]}


async def sweep(ctrl: WsCtrl, entries: list[dict[str, Any]], *, complete: bool = True,
                asked_after_s: float = 1.0) -> list[str]:
    now = ctrl.ctx.now()
    return list(await ctrl.ctx.store.write(partial(
        store_results, node_id="node-a", entries=entries, complete=complete,
        asked_at=now + timedelta(seconds=asked_after_s), now=now)))


async def stopped(ctrl: WsCtrl) -> tuple[str, str]:
    ws = await ctrl.settled((await ctrl.create())["workspace_id"])
    await ctrl.action(ws["workspace_id"], "stop")
    ws = await ctrl.settled(ws["workspace_id"])
    assert ws["state"] == "STOPPED"
    return ws["workspace_id"], ws["instance"]["instance_id"]


async def test_the_observed_result_is_stored_before_the_record_goes(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        wid, iid = await stopped(ctrl)
        before = items(await status(ctrl, wid))
        assert before["RESIDUAL"][:2] == ("PENDING", "node")  # the node keeps the record

        assert await sweep(ctrl, [entry(iid)]) == [iid]
        after = await status(ctrl, wid)
        assert items(after) == dict.fromkeys(ITEMS, ("RELEASED", "node",
                                                     "2026-01-02T03:04:05.678Z"))
        # Stored once: the same result later, whatever the node's list says now.
        assert await sweep(ctrl, []) == []
        assert items(await status(ctrl, wid)) == items(after)


async def test_records_still_needed_are_kept(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        running = await ctrl.settled((await ctrl.create())["workspace_id"])
        current = running["instance"]["instance_id"]
        # The current Instance (its Allocation held) is not collected, and neither is
        # a record of another node's Instance; one ctrl never knew has nothing to keep.
        assert await sweep(ctrl, [entry(current), entry("inst-never-known")],
                           complete=False) == ["inst-never-known"]
        assert items(await status(ctrl, running["workspace_id"]))["RUNTIME"][:2] == \
            ("IN_USE", "node")
        # A Workspace with a command in progress keeps its records too.
        wid, iid = await stopped(ctrl)

        def while_busy(session: Session) -> list[str]:
            ws = session.get(Workspace, wid)
            assert ws is not None
            ws.state = "STARTING"
            now = ctrl.ctx.now()
            kept = store_results(session, node_id="node-a", entries=[entry(iid)],
                                 complete=False, asked_at=now, now=now)
            ws.state = "STOPPED"
            return kept

        assert await ctrl.ctx.store.write(while_busy) == []
        assert await sweep(ctrl, [entry(iid)], complete=False) == [iid]


async def test_a_record_deleted_by_hand_makes_the_runtime_items_unknown(
        tmp_path: Path, autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        wid, _iid = await stopped(ctrl)
        # A truncated list proves nothing; an Instance that ended after the list was
        # asked for may not be in it yet.
        assert await sweep(ctrl, [], complete=False) == []
        assert await sweep(ctrl, [], asked_after_s=-3600) == []
        assert items(await status(ctrl, wid))["RESIDUAL"][:2] == ("PENDING", "node")
        # The node listed everything and the record is not there.
        assert await sweep(ctrl, []) == []
        got = items(await status(ctrl, wid))
        assert {k: v[:2] for k, v in got.items()} == {
            "RUNTIME": ("UNKNOWN", "control_plane"),
            "VOLUME_ATTACHMENT": ("UNKNOWN", "control_plane"),
            "RESIDUAL": ("RELEASED", "control_plane")}


async def test_a_stuck_release_shows_since_when_and_what_is_held(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        ws = await ctrl.settled((await ctrl.create())["workspace_id"])
        wid, iid = ws["workspace_id"], ws["instance"]["instance_id"]
        assert (await status(ctrl, wid))["pending_since"] is None
        held = [{"item": "RUNTIME", "part": "unit kibotos-vmm-x.service: processes 7 "
                                            "survived SIGKILL for 60s"},
                {"item": "VOLUME_ATTACHMENT", "part": "writable layer lay-1 of pool "
                                                      "pool-a (epoch 1)"}]
        frame = InstanceState(type="instance_state", instance_id=iid, workspace_id=wid,
                              state="STOPPING", cleanup={"pending_since": OBSERVED,
                                                         "held": held})
        service = ctrl.service
        await service.feed.instance_state("node-a", frame)

        async def pending() -> dict[str, Any] | None:
            got = await status(ctrl, wid)
            return got if got["pending_since"] is not None else None

        # Applied at once, or just after the create's task ends (frames of an Instance
        # with a task in flight wait for it).
        got = await wait_until(pending, "the pending release shown")
        assert got["pending_since"] == "2026-01-02T03:04:05.678Z"
        assert got["held"] == held
        assert {k: v[:2] for k, v in items(got).items()} == {
            "RUNTIME": ("PENDING", "node"), "VOLUME_ATTACHMENT": ("PENDING", "node"),
            "RESIDUAL": ("IN_USE", "node")}
        # Once the node reaches the final state, nothing is pending any more.
        await service.feed.instance_state("node-a", InstanceState(
            type="instance_state", instance_id=iid, workspace_id=wid, state="STOPPED"))

        async def settled() -> bool:
            return (await status(ctrl, wid))["pending_since"] is None

        await wait_until(settled, "the pending release cleared")
        assert (await status(ctrl, wid))["held"] == []
