"""Pool capacity in ctrl: no capacity set → ``resource_exhausted`` and ``get`` shows it
unset; reservations are the sum of the objects' capacities; ``set-capacity`` never goes
below them, is versioned and journaled (spec: storage-pools-on-nfs, troubleshooting)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from ctrl_helpers import wait_until
from sqlalchemy import delete
from sqlalchemy.orm import Session
from ws_helpers import GI, open_ws_ctrl

from kibotos.core.errors import ResourceExhausted
from kibotos.ctrl.live.context import utcnow
from kibotos.ctrl.pools import capacity as pool_capacity
from kibotos.ctrl.store.models import StoragePool
from kibotos.ctrl.wire.pools import PoolObjectsOut, PoolOut
from kibotos.testing.clock import ThreadAwareClock

INSTANCE = "c" * 32


def pools(pool_id: str = "pool-a", *, shared: bool = False) -> list[dict[str, Any]]:
    return [{"id": pool_id, "shared": shared, "default": True, "driver": "local",
             "available": True, "reason": None, "instance": INSTANCE, "warnings": []}]


async def set_capacity(ctrl: Any, pool_id: str, capacity: int, code: str | None = None,
                       **body: Any) -> Any:
    return await ctrl.call("POST", f"/v1/storage-pools/{pool_id}/set-capacity",
                           json={"capacity_bytes": capacity, **body}, code=code)


async def test_create_without_capacity_is_resource_exhausted(tmp_path: Path, db_url: str,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path, pool_capacity=None, database_url=db_url) as ctrl:
        await ctrl.connect("node-a", pools=pools())
        pool = PoolOut.model_validate(await ctrl.call("GET", "/v1/storage-pools/pool-a"))
        assert pool.capacity_bytes is None
        assert pool.reserved_bytes == 0
        for pinned in ({}, {"node_id": "node-a"}):
            err = await ctrl.create(code="resource_exhausted", **pinned)
            assert "storage pool pool-a has no capacity set" in err["message"]
            assert "kibo storage-pool set-capacity" in err["message"]
        # nothing reached the node, nothing was recorded
        assert not [c for c in ctrl.sims["node-a"].commands
                    if c["kind"] == "instance.create"]
        listed = await ctrl.call("GET", "/v1/workspaces")
        assert listed["workspaces"] == []

        await set_capacity(ctrl, "pool-a", 3 * GI)
        first = await ctrl.create(layer_size_bytes=2 * GI)
        assert first["node_id"] == "node-a"
        err = await ctrl.create(code="resource_exhausted", layer_size_bytes=2 * GI)
        assert "storage pool pool-a has 1.0GiB left" in err["message"]
        err = await ctrl.create(code="resource_exhausted", layer_size_bytes=2 * GI,
                                node_id="node-a")
        assert "does not fit" in err["message"]
        assert err["details"]["reason"] == "capacity_exceeded"
        await ctrl.create(layer_size_bytes=1 * GI)  # exactly full
        pool = PoolOut.model_validate(await ctrl.call("GET", "/v1/storage-pools/pool-a"))
        assert (pool.capacity_bytes, pool.reserved_bytes, pool.free_bytes) == (
            3 * GI, 3 * GI, 0)

        objects = PoolObjectsOut.model_validate(
            await ctrl.call("GET", "/v1/storage-pools/pool-a/objects"))
        assert sorted(o.capacity_bytes for o in objects.objects) == [GI, 2 * GI]
        layer = next(o for o in objects.objects if o.workspace_id == first["workspace_id"])
        assert (layer.kind, layer.holder_node_id, layer.epoch) == (
            "retained_layer", "node-a", 1)

        # a deleted Workspace gives its reservation back
        await ctrl.settled(first["workspace_id"])
        await ctrl.action(first["workspace_id"], "stop")
        await ctrl.settled(first["workspace_id"])
        await ctrl.action(first["workspace_id"], "delete")

        async def released() -> bool:
            got = await ctrl.call("GET", "/v1/storage-pools/pool-a")
            return bool(got["reserved_bytes"] == GI)

        await wait_until(released, "the deleted Workspace's layer no longer reserved")
        assert await ctrl.ctx.store.run(
            lambda s: pool_capacity.reserved_bytes(s, "pool-a")) == GI


async def test_set_capacity_rules(tmp_path: Path, autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path, pool_capacity=None) as ctrl:
        await ctrl.connect("node-a", pools=pools())
        err = await set_capacity(ctrl, "nope", GI, code="not_found")
        assert "storage pool nope does not exist" in err["message"]
        await set_capacity(ctrl, "Bad_Pool", GI, code="invalid_argument")
        await set_capacity(ctrl, "pool-a", 0, code="invalid_argument")
        err = await ctrl.call("POST", "/v1/storage-pools/pool-a/set-capacity",
                              json={"capacity_bytes": GI, "bogus": 1},
                              code="invalid_argument")
        assert "bogus" in err["message"]

        pool = await set_capacity(ctrl, "pool-a", 4 * GI, command_id="cap-1")
        revision = pool["revision"]
        # the same command ID and input replays; other input is already_exists
        again = await set_capacity(ctrl, "pool-a", 4 * GI, command_id="cap-1")
        assert again["revision"] == revision
        await set_capacity(ctrl, "pool-a", 5 * GI, code="already_exists",
                           command_id="cap-1")
        # a stale expected revision changes nothing
        err = await set_capacity(ctrl, "pool-a", 5 * GI, code="aborted",
                                 expected_version=revision - 1)
        assert f"revision {revision}" in err["message"]
        await set_capacity(ctrl, "pool-a", 5 * GI, expected_version=revision)

        await ctrl.create(layer_size_bytes=2 * GI)
        err = await set_capacity(ctrl, "pool-a", GI, code="failed_precondition")
        assert "below the 2.0GiB already reserved" in err["message"]
        assert (await ctrl.call("GET", "/v1/storage-pools/pool-a"))["capacity_bytes"] \
            == 5 * GI
        await set_capacity(ctrl, "pool-a", 2 * GI)  # equal to the reservations is fine


async def test_a_pool_declared_before_ctrl_kept_pool_rows(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    """Facts stored before migration 0004 have no row yet: the pool is listed from its
    members, and set-capacity makes the row."""
    async with open_ws_ctrl(tmp_path, pool_capacity=None) as ctrl:
        await ctrl.connect("node-a", pools=pools())

        def forget_row(session: Session) -> None:
            session.execute(delete(StoragePool))

        await ctrl.ctx.store.write(forget_row)
        got = await ctrl.call("GET", "/v1/storage-pools/pool-a")
        assert (got["revision"], got["capacity_bytes"]) == (0, None)
        assert [m["node_id"] for m in got["members"]] == ["node-a"]
        done = await set_capacity(ctrl, "pool-a", GI)
        assert done["capacity_bytes"] == GI


async def test_two_creates_racing_for_the_last_room(tmp_path: Path, db_url: str,
        autojump_clock: ThreadAwareClock) -> None:
    """Two creates that each fit alone but not together: exactly one is recorded,
    whichever check (the early one or the one in the create's transaction) sees the
    other first."""
    async with open_ws_ctrl(tmp_path, pool_capacity=None, database_url=db_url) as ctrl:
        await ctrl.connect("node-a", pools=pools())
        await set_capacity(ctrl, "pool-a", 3 * GI)

        results: list[Any] = []

        async def one() -> None:
            resp = await ctrl.http.post("/v1/workspaces", headers=ctrl.operator,
                                        json={"template": "base",
                                              "layer_size_bytes": 2 * GI})
            results.append(resp.json())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            nursery.start_soon(one)
        ok = [r for r in results if "result" in r]
        refused = [r for r in results if "error" in r]
        assert len(ok) == 1
        assert len(refused) == 1
        assert refused[0]["error"]["code"] == "resource_exhausted"
        assert (await ctrl.call("GET", "/v1/storage-pools/pool-a"))["reserved_bytes"] \
            == 2 * GI

        # the binding check, as the create's transaction runs it
        def in_the_create_transaction(session: Session) -> None:
            pool_capacity.check_room(session, "pool-a", 2 * GI, "writable layer",
                                     utcnow())

        with pytest.raises(ResourceExhausted, match=r"1\.0GiB left"):
            await ctrl.ctx.store.run(in_the_create_transaction)
        await ctrl.ctx.store.run(lambda s: pool_capacity.check_room(
            s, "pool-a", GI, "writable layer", utcnow()))
