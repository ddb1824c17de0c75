"""HTTP API of storage pools (docs/storage.md, "Storage pools in ctrl"): list, get,
objects, set-capacity, declare-lost.

Reads go straight to the store (`pool_view`); each write is one journaled transaction
(`pool_ops`), replayed from the journal for the same command ID and input.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from sqlalchemy.orm import Session
from starlette.requests import Request

from kibotos.core import ids
from kibotos.ctrl.api.auth import Caller
from kibotos.ctrl.api.routing import Api, Route, read_body, require_true
from kibotos.ctrl.pools import operator_writes as pool_ops
from kibotos.ctrl.pools import view as pool_view
from kibotos.ctrl.wire.pools import (
    DeclareLostIn,
    DeclareLostOut,
    PoolListOut,
    PoolObjectsOut,
    PoolOut,
    SetCapacityIn,
)


def path_pool_id(request: Request) -> str:
    return ids.check_pool_id(request.path_params["pool_id"])


def routes(api: Api) -> list[Route]:
    ctx = api.ctx

    async def list_pools(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await ctx.store.run(pool_view.list_pools)

    async def get_pool(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await ctx.store.run(partial(pool_view.get_pool, pool_id=path_pool_id(request)))

    async def pool_objects(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await ctx.store.run(partial(pool_view.pool_objects,
                                           pool_id=path_pool_id(request)))

    async def set_capacity(request: Request, caller: Caller | None) -> dict[str, Any]:
        assert caller is not None
        pool_id = path_pool_id(request)
        body = await read_body(request, SetCapacityIn)

        def txn(session: Session) -> dict[str, Any]:
            return pool_ops.set_capacity(session, pool_id, body.capacity_bytes,
                                         body.expected_version, ctx.now())

        return await api.journaled("storage_pool.set_capacity", {"pool_id": pool_id}, body, caller,
                                   txn)

    async def declare_lost(request: Request, caller: Caller | None) -> dict[str, Any]:
        assert caller is not None
        pool_id = path_pool_id(request)
        body = await read_body(request, DeclareLostIn)
        require_true(body.confirm_data_lost, "confirm_data_lost",
                     "declare-lost asserts that the pool's storage is gone for good, and "
                     "the Workspaces in it can only be deleted")

        def txn(session: Session) -> dict[str, Any]:
            return pool_ops.declare_lost(session, pool_id, body.expected_version, ctx.now())

        return await api.journaled("storage_pool.declare_lost", {"pool_id": pool_id}, body, caller,
                                   txn)

    return [
        Route("GET", "/v1/storage-pools", list_pools,
              "Every storage pool: capacity, reservations, members", result=PoolListOut),
        Route("GET", "/v1/storage-pools/{pool_id}", get_pool,
              "One storage pool, with each member's availability and refused storages",
              result=PoolOut),
        Route("GET", "/v1/storage-pools/{pool_id}/objects", pool_objects,
              "The retained layers and Volumes in a storage pool", result=PoolObjectsOut),
        Route("POST", "/v1/storage-pools/{pool_id}/set-capacity", set_capacity,
              "Set the pool's capacity (never below its reservations)", body=SetCapacityIn,
              result=PoolOut),
        Route("POST", "/v1/storage-pools/{pool_id}/declare-lost", declare_lost,
              "Declare a pool without members lost: its Workspaces can only be deleted",
              body=DeclareLostIn, result=DeclareLostOut),
    ]
