"""Troubleshooting row "After the node restarts, a batch of Instances becomes FAILED …
storage pool is unavailable" (spec: node-and-vmm-processes): after the storage is
fixed, ctrl can take up to a minute to see the pool recover; "Until then, start
reports no admitted node is ready; retry a little later."  The start is refused with
those words (and the pool's reason), nothing is written, and it succeeds once the
node reports the pool available again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ctrl_helpers import wait_until
from ws_helpers import open_ws_ctrl

from kibotos.testing.clock import ThreadAwareClock


def pools(available: bool) -> list[dict[str, Any]]:
    return [{"id": "node-a-local", "shared": False, "default": True, "driver": "local",
             "available": available, "reason": None if available else
             "storage pool marker is missing", "instance": "a" * 32, "warnings": []}]


async def test_a_start_while_the_pool_is_not_seen_available_says_no_admitted_node_is_ready(
        tmp_path: Path, autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        node = await ctrl.connect("node-a", pools=pools(True))
        ws = await ctrl.settled((await ctrl.create())["workspace_id"])
        wid = ws["workspace_id"]
        await ctrl.action(wid, "stop")
        assert (await ctrl.settled(wid))["state"] == "STOPPED"
        await node.send_report(facts={"pools": pools(False)})

        async def seen_unavailable() -> bool:  # placement follows the report a moment later
            # (read placement's index: a create as the probe would succeed, and place a
            # Workspace, whenever the report has not reached it yet)
            entry = ctrl.runtime.index.nodes.get("node-a")
            fact = entry.pools.get("node-a-local") if entry is not None else None
            return fact is not None and not fact.available

        await wait_until(seen_unavailable, "placement sees the pool unavailable")
        resp = await ctrl.http.post(f"/v1/workspaces/{wid}/start", headers=ctrl.operator,
                                    json={})
        error = resp.json()["error"]
        assert "no admitted node is ready" in error["message"]
        assert "storage pool marker is missing" in error["message"]
        assert "retry a little later" in error["message"]
        assert (await ctrl.ws(wid))["state"] == "STOPPED"
        await node.send_report(facts={"pools": pools(True)})

        async def started() -> bool:
            resp = await ctrl.http.post(f"/v1/workspaces/{wid}/start", headers=ctrl.operator,
                                        json={})
            return "error" not in resp.json()

        await wait_until(started, "the start accepted once the pool is available")
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"
