"""spec/nodes.txt, "drain and cancel-drain": "A drain does one thing: ctrl stops placing
new Workspaces on this node, and the node itself rejects new create requests.  Stop,
delete, and export of existing Workspaces work as usual."  A real ctrl (loopback, real
SQLite) with a simulated node whose ``object.export`` is the node's real code on a real
pool directory, uploading into this ctrl's artifact store."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from ctrl_helpers import wait_until
from transfer_sims import CAPACITY, ExportingSim, node_pool, released_block_file
from volume_helpers import create_volume, settled_volume
from ws_helpers import open_ws_ctrl

MIB = 1 << 20
CAP = CAPACITY  # the block files transfer_sims makes


async def test_a_drained_node_still_stops_deletes_and_exports(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path, in_process=False) as ctrl:
        sim, pool = node_pool(tmp_path, ctrl, "node-a", ExportingSim)
        await ctrl.connect("node-a", sim=sim)
        made = await create_volume(ctrl, pool_id="node-a-local", capacity_bytes=CAP)
        vid = made["volume_id"]
        assert (await settled_volume(ctrl, vid))["state"] == "AVAILABLE"
        await released_block_file(pool, vid, made["epoch"], "node-a",
                                  data=b"written before the drain" * 100, offset=8 * MIB)
        running = (await ctrl.create(node_id="node-a"))["workspace_id"]
        stopped = (await ctrl.create(node_id="node-a"))["workspace_id"]
        for wid in (running, stopped):
            assert (await ctrl.settled(wid))["state"] == "AVAILABLE"
        await ctrl.action(stopped, "stop")
        assert (await ctrl.settled(stopped))["state"] == "STOPPED"

        drained = await ctrl.call("POST", "/v1/nodes/node-a/drain", json={})
        assert drained["drain_requested"] is True

        async def told(value: bool) -> bool:
            return sim.drain_requested is value

        # The node is told (after the answer): it refuses creates too.
        await wait_until(partial(told, True), "node-a told of the drain")
        # No new placement, pinned or not; what runs keeps running (no migration).
        err = await ctrl.create(node_id="node-a", code="failed_precondition")
        assert "drain requested" in err["message"]
        await ctrl.create(code="resource_exhausted")
        assert (await ctrl.ws(running))["state"] == "AVAILABLE"
        await ctrl.action(stopped, "start", code="resource_exhausted")
        # Stop, delete and export work as usual.
        await ctrl.action(running, "stop")
        assert (await ctrl.settled(running))["state"] == "STOPPED"
        await ctrl.action(stopped, "delete")
        assert (await ctrl.settled(stopped))["state"] == "DELETED"
        out = await ctrl.call("POST", "/v1/transfers/export", json={"volume_id": vid})
        assert (out["volume_id"], out["node_id"]) == (vid, "node-a")
        assert [c["kind"] for c in sim.commands].count("object.export") == 1
        blob = ctrl.ctx.config.ctrl.state_dir / "artifacts" / "sha256" / \
            out["artifact_digest"].removeprefix("sha256:")
        assert blob.stat().st_size == out["size"] > 0
        # cancel-drain restores placement.
        await ctrl.call("POST", "/v1/nodes/node-a/cancel-drain", json={})
        await ctrl.wait_eligible("node-a")
        await wait_until(partial(told, False), "node-a told of the cancel")
        again = await ctrl.action(running, "start")
        assert again["node_id"] == "node-a"
