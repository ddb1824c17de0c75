"""``GET /v1/workspaces/{id}/move-check``, the Check step of `kibo workspace move`
(spec: nodes, "Placing a Workspace on a specific node"): "If the Workspace already runs
on the target node, the command succeeds directly without stopping it" — only a
Workspace that runs there.  A FAILED one keeps its node until ``stop --force`` (its
Instance still holds resources), but it does not run: a move must not report success
for it.  A real ctrl (loopback, real SQLite) with simulated nodes."""

from __future__ import annotations

from pathlib import Path

from ctrl_helpers import wait_until
from volume_helpers import create_volume, settled_volume
from ws_helpers import open_ws_ctrl

from kibotos.testing.clock import ThreadAwareClock

SHARED = [{"id": "shared-1", "shared": True, "default": True}]


async def test_already_there_only_while_it_runs_there(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", pools=SHARED)
        await ctrl.connect("node-b", pools=SHARED)
        ws = await ctrl.settled((await ctrl.create(node_id="node-a"))["workspace_id"])
        wid = ws["workspace_id"]

        async def check(node_id: str) -> dict:
            return dict(await ctrl.call("GET", f"/v1/workspaces/{wid}/move-check",
                                        params={"node_id": node_id}))

        running = await check("node-a")
        assert (running["already_there"], running["workspace"]["state"]) == (True,
                                                                             "AVAILABLE")
        assert (await check("node-b"))["already_there"] is False
        # The VMM exits unexpectedly: FAILED, still on node-a until stop --force.
        await ctrl.sims["node-a"].exit(ws["instance_id"])

        async def failed() -> bool:
            return (await ctrl.ws(wid))["state"] == "FAILED"

        await wait_until(failed, "the Workspace is FAILED")
        assert (await ctrl.ws(wid))["node_id"] == "node-a"
        there = await check("node-a")
        assert there["workspace"]["state"] == "FAILED"
        assert there["already_there"] is False  # it does not run there
        # So the move goes on to its start, which says what to do first.
        err = await ctrl.action(wid, "start", code="failed_precondition", node_id="node-a")
        assert f"kibo workspace stop {wid} --force" in err["message"]
        await ctrl.action(wid, "stop", force=True)
        assert (await ctrl.settled(wid))["state"] == "STOPPED"
        assert (await check("node-a"))["already_there"] is False


async def test_a_volume_the_target_cannot_reach_stops_the_move(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    """The Check row reads the pools of the Volumes as well as the writable layer's."""
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", pools=[*SHARED, {"id": "node-a-local", "shared": False,
                                                      "default": False}])
        await ctrl.connect("node-b", pools=SHARED)
        vid = (await create_volume(ctrl, pool_id="node-a-local"))["volume_id"]
        await settled_volume(ctrl, vid)
        ws = await ctrl.settled((await ctrl.create(
            node_id="node-a", volumes=[{"volume_id": vid}]))["workspace_id"])
        wid = ws["workspace_id"]
        assert ws["layer"]["pool_id"] == "shared-1"
        err = await ctrl.call("GET", f"/v1/workspaces/{wid}/move-check",
                              params={"node_id": "node-b"}, code="failed_precondition")
        assert (err["details"]["pool_id"], err["details"]["object_id"]) == ("node-a-local",
                                                                            vid)
        assert "not attached to" in err["message"]
        after = await ctrl.ws(wid)
        assert (after["state"], after["node_id"], after["revision"]) == (
            "AVAILABLE", "node-a", ws["revision"])
        there = await ctrl.call("GET", f"/v1/workspaces/{wid}/move-check",
                                params={"node_id": "node-a"})
        assert there["already_there"] is True
        assert {(o["kind"], o["pool_id"]) for o in there["objects"]} == {
            ("retained_layer", "shared-1"), ("volume", "node-a-local")}
