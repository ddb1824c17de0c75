"""Moving a pool to another host (spec: storage-pools-on-nfs, "Moving a pool to another
host"): isolate and retire the first node, declare the same pool ID (same marker
instance) on a new node; it becomes the pool's member and registered node, pending
cleanup runs on it, and existing Workspaces start there with a newer epoch.  Simulated
nodes on a real ctrl (loopback, real SQLite), as the other placement tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ctrl_helpers import wait_until
from ws_helpers import GI, open_ws_ctrl

from kibotos.testing.clock import ThreadAwareClock

MARKER = "d" * 32
OTHER = "e" * 32


def pools(instance: str, pool_id: str = "pool-a", *, shared: bool = False
          ) -> list[dict[str, Any]]:
    return [{"id": pool_id, "shared": shared, "default": True, "driver": "local",
             "available": True, "reason": None, "instance": instance, "warnings": []}]


async def pool(ctrl: Any, pool_id: str = "pool-a") -> dict[str, Any]:
    return dict(await ctrl.call("GET", f"/v1/storage-pools/{pool_id}"))


async def stopped_workspace(ctrl: Any) -> str:
    ws = await ctrl.create(node_id="node-a", layer_size_bytes=GI)
    assert (await ctrl.settled(ws["workspace_id"]))["state"] == "AVAILABLE"
    await ctrl.action(ws["workspace_id"], "stop")
    assert (await ctrl.settled(ws["workspace_id"]))["state"] == "STOPPED"
    return str(ws["workspace_id"])


async def isolate_and_retire(ctrl: Any, node_id: str) -> None:
    await ctrl.disconnect(node_id)
    await ctrl.call("POST", f"/v1/nodes/{node_id}/isolate",
                    json={"confirm_host_cannot_write": True})
    await ctrl.call("POST", f"/v1/nodes/{node_id}/retire", json={})


async def test_moving_a_pool_to_another_host(tmp_path: Path, db_url: str,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path, pool_capacity=None, database_url=db_url) as ctrl:
        await ctrl.connect("node-a", pools=pools(MARKER))
        await ctrl.call("POST", "/v1/storage-pools/pool-a/set-capacity",
                        json={"capacity_bytes": 10 * GI})
        keep = await stopped_workspace(ctrl)
        gone = await stopped_workspace(ctrl)
        before = await pool(ctrl)
        assert before["mode"] == "standalone"
        assert before["registered_node_id"] == "node-a"
        assert [m["node_id"] for m in before["members"]] == ["node-a"]

        # the host is lost: its node is cut off; a delete waits for a node of the pool
        await ctrl.disconnect("node-a")
        offline = (await pool(ctrl))["members"][0]
        assert offline["available"] is False
        assert "no live control session" in offline["reason"]
        await ctrl.action(gone, "delete")
        assert (await ctrl.ws(gone))["state"] == "DELETING"
        await ctrl.call("POST", "/v1/nodes/node-a/isolate",
                        json={"confirm_host_cannot_write": True})
        await ctrl.call("POST", "/v1/nodes/node-a/retire", json={})
        lonely = await pool(ctrl)
        assert lonely["members"] == []
        assert lonely["registered_node_id"] is None
        assert lonely["reserved_bytes"] == 2 * GI  # the objects are still there
        assert (await ctrl.ws(gone))["state"] == "DELETING"

        # the disk is attached to a new host, declared with the same pool ID
        await ctrl.connect("node-b", pools=pools(MARKER))
        after = await pool(ctrl)
        assert after["registered_node_id"] == "node-b"
        assert after["instance"] == MARKER
        assert [(m["node_id"], m["available"]) for m in after["members"]] == [
            ("node-b", True)]

        # pending physical cleanup runs on the new node, with a newer epoch
        async def deleted() -> bool:
            return (await ctrl.ws(gone))["state"] == "DELETED"

        await wait_until(deleted, "the pending delete finished on node-b")
        gone_ref = next(ref for p, ref, _ in ctrl.sims["node-b"].deleted_layers
                        if p == "pool-a")
        assert [e for _, ref, e in ctrl.sims["node-b"].deleted_layers
                if ref == gone_ref] == [2]

        # the Workspace starts there: the layer is opened (not created) at epoch 2
        started = await ctrl.action(keep, "start")
        assert started["node_id"] == "node-b"
        assert (await ctrl.settled(keep))["state"] == "AVAILABLE"
        creates = [c["args"] for c in ctrl.sims["node-b"].commands
                   if c["kind"] == "instance.create"]
        assert [(c["workspace_id"], c["layer"]["pool_id"], c["layer"]["epoch"],
                 c["layer"]["create"]) for c in creates] == [(keep, "pool-a", 2, False)]
        objects = (await ctrl.call("GET", "/v1/storage-pools/pool-a/objects"))["objects"]
        assert [(o["workspace_id"], o["holder_node_id"], o["epoch"]) for o in objects] == [
            (keep, "node-b", 2)]
        # the Node list no longer counts node-a as a member anywhere
        assert (await pool(ctrl))["reserved_bytes"] == GI


async def test_a_refused_storage_is_accepted_once_the_first_node_is_retired(
        tmp_path: Path, autojump_clock: ThreadAwareClock) -> None:
    """No new hello or report is needed: retiring the first node reconsiders the
    storages that were refused because of it."""
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", pools=pools(MARKER))
        await ctrl.connect("node-b", pools=pools(OTHER))
        got = await pool(ctrl)
        assert got["instance"] == MARKER
        assert [r["node_id"] for r in got["refused"]] == ["node-b"]
        assert got["refused"][0]["first_instance"] == MARKER
        member_b = next(m for m in got["members"] if m["node_id"] == "node-b")
        assert member_b["available"] is False
        assert member_b["refused"] is True
        assert "node-a joined first" in member_b["reason"]

        # retiring an unrelated node changes nothing for node-b (not even its version)
        await ctrl.connect("node-c", pools=pools(MARKER, "pool-c"))
        version = (await ctrl.node("node-b"))["registration_version"]
        await isolate_and_retire(ctrl, "node-c")
        assert (await ctrl.node("node-b"))["registration_version"] == version
        assert [r["node_id"] for r in (await pool(ctrl))["refused"]] == ["node-b"]

        await isolate_and_retire(ctrl, "node-a")
        got = await pool(ctrl)
        assert got["refused"] == []
        assert got["instance"] == OTHER
        assert got["registered_node_id"] == "node-b"
        assert [(m["node_id"], m["available"], m["reason"]) for m in got["members"]] == [
            ("node-b", True, None)]

        async def placed_on_b() -> bool:  # placement's index follows the store
            resp = await ctrl.http.post("/v1/workspaces", headers=ctrl.operator,
                                        json={"template": "base", "node_id": "node-b"})
            return resp.status_code == 200

        await wait_until(placed_on_b, "a create pinned to node-b accepted")


async def test_a_revoked_node_is_not_a_member(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", pools=pools(MARKER, "shared-1", shared=True))
        await ctrl.connect("node-b", pools=pools(MARKER, "shared-1", shared=True))
        assert [m["node_id"] for m in (await pool(ctrl, "shared-1"))["members"]] == [
            "node-a", "node-b"]
        grants = await ctrl.call("GET", "/v1/enrollment/grants")
        identity = next(i["identity_id"] for i in grants["identities"]
                        if i["node_id"] == "node-a")
        await ctrl.call("POST", "/v1/enrollment/revoke", json={"id": identity})
        got = await pool(ctrl, "shared-1")
        assert got["mode"] == "shared"
        assert [m["node_id"] for m in got["members"]] == ["node-b"]
        listed = await ctrl.call("GET", "/v1/storage-pools")
        assert [p["pool_id"] for p in listed["pools"]] == ["shared-1"]
