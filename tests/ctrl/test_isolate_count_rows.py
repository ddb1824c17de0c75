"""spec/nodes.txt, isolate: "The result gives ... the number of Workspaces that failed
as a result."  A Workspace that was FAILED already (its VMM exited; it keeps its node
until ``stop --force``) did not fail because of the isolate: it is released with the
rest but not counted.  A real ctrl (loopback, real SQLite) with simulated nodes."""

from __future__ import annotations

from pathlib import Path

from ctrl_helpers import wait_until
from ws_helpers import open_ws_ctrl

from kibotos.testing.clock import ThreadAwareClock

SHARED = [{"id": "shared-1", "shared": True, "default": True}]


async def test_a_workspace_failed_before_the_isolate_is_not_counted(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", pools=SHARED)
        await ctrl.connect("node-b", pools=SHARED)
        running = (await ctrl.settled((await ctrl.create(node_id="node-a"))["workspace_id"]))
        exited = await ctrl.settled((await ctrl.create(node_id="node-a"))["workspace_id"])
        await ctrl.sims["node-a"].exit(exited["instance_id"])

        async def failed() -> bool:
            return (await ctrl.ws(exited["workspace_id"]))["state"] == "FAILED"

        await wait_until(failed, "the exited Workspace FAILED")
        assert (await ctrl.ws(exited["workspace_id"]))["node_id"] == "node-a"
        await ctrl.disconnect("node-a")
        result = await ctrl.call("POST", "/v1/nodes/node-a/isolate",
                                 json={"confirm_host_cannot_write": True})
        assert result["failed_workspaces"] == 1  # the running one only
        assert result["released_retained_layers"] == 2  # both layers were node-a's
        for ws in (running, exited):
            got = await ctrl.ws(ws["workspace_id"])
            assert (got["state"], got["node_id"], got["instance_id"]) == ("FAILED", None,
                                                                          None)
        # Both released: each starts on node-b without a force stop.
        for ws in (running, exited):
            started = await ctrl.action(ws["workspace_id"], "start")
            assert started["node_id"] == "node-b"
            assert (await ctrl.settled(ws["workspace_id"]))["state"] == "AVAILABLE"
