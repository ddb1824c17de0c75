"""spec node-and-vmm-processes, "Launch records and adoption": "Stopping the node is not
the same as deleting Instances, and it does not set or clear drain."  A node whose
session ends (its service stopped) and that comes back with a new incarnation keeps the
drain it had, and its Workspaces keep running; ctrl deletes nothing meanwhile."""

from __future__ import annotations

from pathlib import Path

from ctrl_helpers import wait_until
from ws_helpers import open_ws_ctrl

from kibotos.testing.clock import ThreadAwareClock


async def test_a_node_restart_neither_sets_nor_clears_drain(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        await ctrl.connect("node-b")
        wa = await ctrl.settled((await ctrl.create(node_id="node-a"))["workspace_id"])
        wb = await ctrl.settled((await ctrl.create(node_id="node-b"))["workspace_id"])
        drained = await ctrl.call("POST", "/v1/nodes/node-a/drain", json={})
        assert drained["drain_requested"] is True
        for node_id in ("node-a", "node-b"):
            sim = ctrl.sims[node_id]
            await ctrl.disconnect(node_id)  # the node service stopped
            await ctrl.connect(node_id, sim=sim, wait_eligible=node_id == "node-b")

            async def back(node_id: str = node_id) -> bool:
                session = (await ctrl.node(node_id))["latest_session"]
                return bool(session and session["incarnation"] == 2 and session["alive"])

            await wait_until(back, f"{node_id} is back with incarnation 2")
        # ctrl has reconciled the Instance lists the nodes sent with their hello: a
        # Workspace created now lands after that, on the undrained node.
        wc = await ctrl.settled((await ctrl.create())["workspace_id"])
        assert wc["node_id"] == "node-b"
        assert (await ctrl.node("node-a"))["drain_requested"] is True
        assert (await ctrl.node("node-b"))["drain_requested"] is False
        for ws, node_id in ((wa, "node-a"), (wb, "node-b")):
            now = await ctrl.ws(ws["workspace_id"])
            assert (now["state"], now["instance_id"]) == ("AVAILABLE", ws["instance_id"])
            assert ws["instance_id"] in ctrl.sims[node_id].instances
            assert not ctrl.sims[node_id].destroyed
