"""Request and result shapes of the storage pool API (`api_pools`).

Request models forbid unknown fields and check values before the command journal sees
them (bad input writes nothing); result models describe what the handlers return, so
the OpenAPI document and the tests can hold the handlers to them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kibotos.ctrl.wire.base import Result, VersionedWrite

#: 1 EiB: a capacity beyond this is a typo, not a disk.
MAX_CAPACITY_BYTES = 1 << 60


class SetCapacityIn(VersionedWrite):
    """``expected_version`` is the pool's ``revision``."""

    capacity_bytes: int = Field(gt=0, le=MAX_CAPACITY_BYTES)


class DeclareLostIn(VersionedWrite):
    confirm_data_lost: bool = False


class PoolMemberOut(Result):
    node_id: str
    node_status: str
    available: bool
    reason: str | None
    shared: bool
    default: bool
    driver: str | None
    instance: str | None
    refused: bool
    warnings: list[str]


class PoolRefusedOut(Result):
    node_id: str
    instance: str | None
    reason: str | None
    first_node_id: str | None
    first_instance: str | None


class PoolOut(Result):
    pool_id: str
    mode: Literal["shared", "standalone"]
    shared: bool
    capacity_bytes: int | None
    reserved_bytes: int
    free_bytes: int | None
    instance: str | None
    registered_node_id: str | None
    lost: bool
    lost_at: str | None
    lost_instance: str | None
    revision: int
    created_at: str | None
    updated_at: str | None
    members: list[PoolMemberOut]
    available_members: int
    refused: list[PoolRefusedOut]


class PoolListOut(Result):
    pools: list[PoolOut]


class PoolObjectOut(Result):
    kind: Literal["retained_layer", "volume"]
    object_id: str
    pool_id: str
    capacity_bytes: int
    workspace_id: str | None
    workspace_state: str | None
    holder_node_id: str | None
    last_holder_node_id: str | None
    epoch: int | None


class PoolObjectsOut(Result):
    pool_id: str
    objects: list[PoolObjectOut]


class DeclareLostOut(Result):
    pool: PoolOut
    failed_workspaces: list[str]
    forgotten_objects: int
