"""What nodes do to Workspaces: isolate (releases, counts, restart by pool), retire
(cleanup status from the control plane), a VMM that exits or is OOM-killed, and the
reconciliation of a node's full Instance list after a reconnect."""

from __future__ import annotations

from pathlib import Path

from ctrl_helpers import wait_until
from ws_helpers import WsCtrl, away_with_one_lost_and_one_stray, open_ws_ctrl

from kibotos.ctrl.wire.workspaces import CleanupStatusOut
from kibotos.testing.clock import ThreadAwareClock

SHARED = [{"id": "shared-1", "shared": True, "default": True}]
EXITED = "node reports the Instance as no longer running"


async def isolate(ctrl: WsCtrl, node_id: str, code: str | None = None) -> dict:
    return dict(await ctrl.call("POST", f"/v1/nodes/{node_id}/isolate",
                                json={"confirm_host_cannot_write": True}, code=code))


async def cleanup(ctrl: WsCtrl, wid: str) -> dict[str, tuple[str, str]]:
    got = await ctrl.call("GET", f"/v1/workspaces/{wid}/cleanup-status")
    CleanupStatusOut.model_validate(got)
    return {i["item"]: (i["status"], i["source"]) for i in got["items"]}


async def test_isolate_releases_fails_and_counts(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        await ctrl.connect("node-b")
        running = (await ctrl.create(node_id="node-a"))["workspace_id"]
        stopped = (await ctrl.create(node_id="node-a"))["workspace_id"]
        elsewhere = (await ctrl.create(node_id="node-b"))["workspace_id"]
        for wid in (running, stopped, elsewhere):
            await ctrl.settled(wid)
        await ctrl.action(stopped, "stop")
        await ctrl.settled(stopped)
        assert await cleanup(ctrl, running) == {
            "RUNTIME": ("IN_USE", "node"), "VOLUME_ATTACHMENT": ("IN_USE", "node"),
            "RESIDUAL": ("IN_USE", "node")}
        await isolate(ctrl, "node-a", code="failed_precondition")  # session alive
        await ctrl.disconnect("node-a")
        result = await isolate(ctrl, "node-a")
        # Both retained layers were node-a's (private pool, kept after the stop).
        assert result["released_retained_layers"] == 2
        assert result["released_volumes"] == 0
        assert result["failed_workspaces"] == 1
        ws = await ctrl.ws(running)
        assert (ws["state"], ws["reason"]) == ("FAILED", "UNAVAILABLE")
        assert ws["node_id"] is None
        assert ws["instance_id"] is None
        assert (await ctrl.ws(stopped))["state"] == "STOPPED"
        assert (await ctrl.ws(elsewhere))["state"] == "AVAILABLE"
        assert ctrl.runtime.index.allocated("node-a") == (0, 0)
        assert await cleanup(ctrl, running) == {
            "RUNTIME": ("UNKNOWN", "control_plane"),
            "VOLUME_ATTACHMENT": ("RELEASED", "control_plane"),
            "RESIDUAL": ("UNKNOWN", "control_plane")}
        assert (await ctrl.call("GET", "/v1/workspace-locations",
                                params={"node_id": "node-a"}))["locations"] == []
        # Private pool: it can start again only once node-a is back.
        err = await ctrl.action(running, "start", code="resource_exhausted")
        assert "not attached to pool node-a-local" in err["message"]
        # The node returns with a new incarnation, having destroyed what it ran.
        sim = ctrl.sims["node-a"]
        await sim.destroy_all()
        await ctrl.connect("node-a")
        started = await ctrl.action(running, "start")
        assert started["node_id"] == "node-a"
        # Granted again after an isolate: a new epoch even on the same node.
        assert sim.commands[-1]["args"]["layer"]["epoch"] == 2
        assert (await ctrl.settled(running))["state"] == "AVAILABLE"


async def test_isolate_shared_pool_starts_elsewhere_at_once(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", pools=SHARED)
        await ctrl.connect("node-b", pools=SHARED)
        wid = (await ctrl.create(node_id="node-a"))["workspace_id"]
        await ctrl.settled(wid)
        await ctrl.disconnect("node-a")
        result = await isolate(ctrl, "node-a")
        assert (result["released_retained_layers"], result["failed_workspaces"]) == (1, 1)
        started = await ctrl.action(wid, "start")
        assert started["node_id"] == "node-b"
        args = ctrl.sims["node-b"].commands[-1]["args"]
        assert args["layer"]["pool_id"] == "shared-1"
        assert args["layer"]["epoch"] == 2
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"


async def test_isolate_fails_a_pending_stop(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        wid = (await ctrl.create())["workspace_id"]
        await ctrl.settled(wid)
        await ctrl.disconnect("node-a")
        # The stop cannot reach the node: it stays STOPPING until the isolate.
        assert (await ctrl.action(wid, "stop"))["state"] == "STOPPING"
        assert (await ctrl.ws(wid, wait_s=0.5))["state"] == "STOPPING"
        result = await isolate(ctrl, "node-a")
        assert result["failed_workspaces"] == 1
        ws = await ctrl.ws(wid)
        assert (ws["state"], ws["reason"]) == ("FAILED", "UNAVAILABLE")


async def test_retire_after_isolate_releases_cleanup_status(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        wid = (await ctrl.create())["workspace_id"]
        await ctrl.settled(wid)
        await ctrl.disconnect("node-a")
        await isolate(ctrl, "node-a")
        await ctrl.call("POST", "/v1/nodes/node-a/retire", json={})
        assert await cleanup(ctrl, wid) == dict.fromkeys(
            ("RUNTIME", "VOLUME_ATTACHMENT", "RESIDUAL"), ("RELEASED", "control_plane"))


async def test_stop_reports_cleanup_from_the_node(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        wid = (await ctrl.create())["workspace_id"]
        await ctrl.settled(wid)
        await ctrl.action(wid, "stop")
        await ctrl.settled(wid)
        assert await cleanup(ctrl, wid) == {
            "RUNTIME": ("RELEASED", "node"), "VOLUME_ATTACHMENT": ("RELEASED", "node"),
            "RESIDUAL": ("PENDING", "node")}


async def test_oom_kill_stops_the_workspace_and_start_works(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        ws = await ctrl.settled((await ctrl.create())["workspace_id"])
        wid = ws["workspace_id"]
        await ctrl.sims["node-a"].exit(ws["instance_id"], "oom_killed")

        async def stopped() -> bool:
            return (await ctrl.ws(wid))["state"] == "STOPPED"

        await wait_until(stopped, "ctrl stopped the OOM-killed Workspace")
        ws = await ctrl.ws(wid)
        assert ws["reason"] == "OOM_KILLED"
        assert ctrl.runtime.index.allocated("node-a") == (0, 0)
        stops = [c["args"] for c in ctrl.sims["node-a"].commands if c["kind"] == "instance.stop"]
        assert stops == [{"instance_id": ws["last_instance_id"], "force": False,
                          "deadline_s": 30.0}]
        await ctrl.action(wid, "start")
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"


async def test_unexpected_exit_fails_until_stop_force(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        ws = await ctrl.settled((await ctrl.create(cpu_millis=1500))["workspace_id"])
        wid = ws["workspace_id"]
        await ctrl.sims["node-a"].exit(ws["instance_id"])

        async def failed() -> bool:
            return (await ctrl.ws(wid))["state"] == "FAILED"

        await wait_until(failed, "the Workspace is FAILED")
        ws = await ctrl.ws(wid)
        assert ws["reason"] == EXITED
        # It keeps its Allocation (and stays on the node) until stop --force.
        assert ctrl.runtime.index.allocated("node-a")[0] == 1500
        assert ws["node_id"] == "node-a"
        err = await ctrl.action(wid, "start", code="failed_precondition")
        assert f"kibo workspace stop {wid} --force" in err["message"]
        await ctrl.action(wid, "stop", force=True)
        ws = await ctrl.settled(wid)
        assert ws["state"] == "STOPPED"
        assert ws["instance"]["confirmed_on_disk"] is False
        assert ctrl.runtime.index.allocated("node-a") == (0, 0)
        await ctrl.action(wid, "start")
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"


async def test_reconnect_reconciles_the_instance_list(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        # While away the node lost one Instance and gained one ctrl never recorded.
        kept, lost, sim = await away_with_one_lost_and_one_stray(ctrl)
        await ctrl.connect("node-a", sim=sim)

        async def reconciled() -> bool:
            return ("inst-stray" in sim.destroyed
                    and (await ctrl.ws(lost["workspace_id"]))["state"] == "FAILED")

        await wait_until(reconciled, "the stray Instance destroyed, the lost one FAILED")
        assert (await ctrl.ws(lost["workspace_id"]))["reason"] == EXITED
        assert (await ctrl.ws(kept["workspace_id"]))["state"] == "AVAILABLE"
        # The lost Instance holds nothing: start works at once.
        await ctrl.action(lost["workspace_id"], "start")
        assert (await ctrl.settled(lost["workspace_id"]))["state"] == "AVAILABLE"


async def test_delete_waits_for_the_node_of_a_private_pool(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        wid = (await ctrl.create())["workspace_id"]
        await ctrl.settled(wid)
        await ctrl.action(wid, "stop")
        await ctrl.settled(wid)
        await ctrl.disconnect("node-a")
        assert (await ctrl.action(wid, "delete"))["state"] == "DELETING"
        assert (await ctrl.ws(wid, wait_s=1.0))["state"] == "DELETING"
        await ctrl.connect("node-a")
        assert (await ctrl.settled(wid))["state"] == "DELETED"
        assert len(ctrl.sims["node-a"].deleted_layers) == 1


async def test_an_instance_kept_across_an_isolate_is_destroyed(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        ws = await ctrl.settled((await ctrl.create())["workspace_id"])
        await ctrl.disconnect("node-a")
        await isolate(ctrl, "node-a")
        sim = ctrl.sims["node-a"]
        assert ws["instance_id"] in sim.instances  # the host kept running it
        await ctrl.connect("node-a")  # a new incarnation: the isolate clears

        async def discarded() -> bool:
            return ws["instance_id"] in sim.destroyed

        await wait_until(discarded, "ctrl destroyed the Instance it no longer wants")
        started = await ctrl.action(ws["workspace_id"], "start")
        assert started["node_id"] == "node-a"
        assert (await ctrl.settled(ws["workspace_id"]))["state"] == "AVAILABLE"
