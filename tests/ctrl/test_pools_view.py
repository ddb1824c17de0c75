"""``get`` follows what the members report: the troubleshooting row "after
storage-pool init, get shows this node as available" without a new session, an
offline or isolated member's pool is not available, and list shows every pool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ctrl_helpers import wait_until
from ws_helpers import open_ws_ctrl

from kibotos.ctrl.wire.pools import PoolListOut
from kibotos.testing.clock import ThreadAwareClock

MARKER = "a1" * 16


def entry(pool_id: str, *, instance: str | None = MARKER, available: bool = True,
          reason: str | None = None, shared: bool = False,
          default: bool = True) -> dict[str, Any]:
    return {"id": pool_id, "shared": shared, "default": default, "driver": "local",
            "available": available, "reason": reason, "instance": instance,
            "warnings": []}


async def member(ctrl: Any, pool_id: str, node_id: str) -> dict[str, Any]:
    got = await ctrl.call("GET", f"/v1/storage-pools/{pool_id}")
    return dict(next(m for m in got["members"] if m["node_id"] == node_id))


async def test_get_follows_the_members_reports(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        missing = entry("pool-a", instance=None, available=False,
                        reason="storage pool marker is missing")
        node = await ctrl.connect("node-a", pools=[missing, entry(
            "shared-1", instance="b2" * 16, shared=True, default=False)])
        got = await member(ctrl, "pool-a", "node-a")
        assert (got["available"], got["reason"]) == (False, "storage pool marker is missing")
        # `kibotos-node storage-pool init` on the node: its next report says available
        await node.send_report(facts={"pools": [entry("pool-a"), entry(
            "shared-1", instance="b2" * 16, shared=True, default=False)]})

        async def available() -> bool:
            return bool((await member(ctrl, "pool-a", "node-a"))["available"])

        await wait_until(available, "pool-a available on node-a after the report")
        listed = PoolListOut.model_validate(await ctrl.call("GET", "/v1/storage-pools"))
        assert [(p.pool_id, p.mode, p.instance) for p in listed.pools] == [
            ("pool-a", "standalone", MARKER), ("shared-1", "shared", "b2" * 16)]

        await ctrl.disconnect("node-a")
        got = await member(ctrl, "pool-a", "node-a")
        assert got["available"] is False
        assert got["reason"] == "node node-a is OFFLINE: no live control session"
        await ctrl.call("POST", "/v1/nodes/node-a/isolate",
                        json={"confirm_host_cannot_write": True})
        got = await member(ctrl, "pool-a", "node-a")
        assert (got["node_status"], got["reason"]) == ("ISOLATED", "node node-a is isolated")
        err = await ctrl.call("GET", "/v1/storage-pools/nope", code="not_found")
        assert "storage pool nope does not exist" in err["message"]
        await ctrl.call("GET", "/v1/storage-pools/Bad..Pool", code="invalid_argument")
