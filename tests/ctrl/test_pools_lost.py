"""``declare-lost``: refused while the pool has members and without the confirmation;
then the pool is lost, its stopped Workspaces FAILED for good (they can only be
deleted, and deletes finish without a node), journaled like every write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ctrl_helpers import wait_until
from ws_helpers import GI, open_ws_ctrl

from kibotos.ctrl.pools.operator_writes import lost_reason
from kibotos.ctrl.wire.pools import DeclareLostOut
from kibotos.testing.clock import ThreadAwareClock

MARKER = "f" * 32
LOST = "/v1/storage-pools/pool-a/declare-lost"


def pools() -> list[dict[str, Any]]:
    return [{"id": "pool-a", "shared": False, "default": True, "driver": "local",
             "available": True, "reason": None, "instance": MARKER, "warnings": []}]


async def test_declare_lost(tmp_path: Path, db_url: str, autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path, database_url=db_url) as ctrl:
        await ctrl.connect("node-a", pools=pools())
        ids = []
        for _ in range(2):
            ws = await ctrl.create(layer_size_bytes=GI)
            await ctrl.settled(ws["workspace_id"])
            await ctrl.action(ws["workspace_id"], "stop")
            await ctrl.settled(ws["workspace_id"])
            ids.append(ws["workspace_id"])
        keep, deleting = ids
        await ctrl.disconnect("node-a")
        await ctrl.action(deleting, "delete")

        err = await ctrl.call("POST", LOST, json={}, code="invalid_argument")
        assert "confirm_data_lost" in err["message"]
        err = await ctrl.call("POST", LOST, json={"confirm_data_lost": True},
                              code="failed_precondition")
        assert "still has member nodes: node-a (OFFLINE)" in err["message"]
        await ctrl.call("POST", "/v1/storage-pools/nope/declare-lost",
                        json={"confirm_data_lost": True}, code="not_found")

        await ctrl.call("POST", "/v1/nodes/node-a/isolate",
                        json={"confirm_host_cannot_write": True})
        await ctrl.call("POST", "/v1/nodes/node-a/retire", json={})
        revision = (await ctrl.call("GET", "/v1/storage-pools/pool-a"))["revision"]
        await ctrl.call("POST", LOST, json={"confirm_data_lost": True,
                                            "expected_version": revision + 5},
                        code="aborted")
        body = {"confirm_data_lost": True, "command_id": "lost-1",
                "expected_version": revision}
        result = DeclareLostOut.model_validate(await ctrl.call("POST", LOST, json=body))
        assert result.failed_workspaces == [keep]
        assert result.forgotten_objects == 1
        assert result.pool.lost is True
        assert result.pool.lost_instance == MARKER
        assert result.pool.instance is None
        # a replay answers the same; a second declaration is refused
        replay = await ctrl.call("POST", LOST, json=body)
        assert replay == result.model_dump()
        err = await ctrl.call("POST", LOST, json={"confirm_data_lost": True},
                              code="failed_precondition")
        assert "already declared lost" in err["message"]
        await ctrl.call("POST", "/v1/storage-pools/pool-a/set-capacity",
                        json={"capacity_bytes": GI}, code="failed_precondition")

        # the delete that waited for a node finishes without one
        async def deleted(workspace_id: str) -> bool:
            return (await ctrl.ws(workspace_id))["state"] == "DELETED"

        await wait_until(lambda: deleted(deleting), "the waiting delete finished")
        got = await ctrl.ws(keep)
        assert got["state"] == "FAILED"
        assert got["reason"] == lost_reason("pool-a")
        err = await ctrl.action(keep, "start", code="failed_precondition")
        assert "storage pool pool-a was declared lost" in err["message"]
        await ctrl.action(keep, "delete")
        await wait_until(lambda: deleted(keep), "a delete after declare-lost finished")
        assert (await ctrl.call("GET", "/v1/storage-pools/pool-a"))["reserved_bytes"] == 0

        # another storage declared with the pool ID registers anew
        await ctrl.connect("node-b", pools=[{**pools()[0], "instance": "9" * 32}])
        again = await ctrl.call("GET", "/v1/storage-pools/pool-a")
        assert again["lost"] is False
        assert again["registered_node_id"] == "node-b"
