"""Pool capacity and reservations: what a storage pool has promised to its objects.

A pool's capacity is set by the operator on ctrl (``kibo storage-pool set-capacity``;
spec: storage-pools-on-nfs, "Pool capacity"), never by the node.  Each object in the
pool reserves its whole capacity, whatever its block file really uses (block files are
sparse and only grow), so the sum of reservations never exceeds the capacity: a create
that would, or any create in a pool whose capacity was never set, is
``resource_exhausted`` and nothing is written.

Objects: the retained layer of every Workspace that is not DELETED (its
``layer_size_bytes`` in ``layer_pool_id``), plus what `volume_pools` counts (Volumes,
and the room that running expansions and moves hold), so one function answers "what
is reserved here".

Two entry points for a create: `room` + `check_snapshot` before the node is asked
(no node creates a block file that would be refused), and `check_room` inside the
create's own transaction, with the pool row locked, which is the binding check (two
creates racing for the last room cannot both pass).  Both sum one pool's objects through
the index on the Workspaces' layer pool, so a create costs the same whatever the number
of pools and Workspaces; `snapshot` (every pool at once) is for the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import BindParameter, Select, bindparam, exists, func, select
from sqlalchemy.orm import Session

from kibotos.core.errors import ResourceExhausted
from kibotos.core.units import format_bytes
from kibotos.ctrl.model import nodes
from kibotos.ctrl.model import workspace_records as w
from kibotos.ctrl.pools import use_rights, volume_pools
from kibotos.ctrl.store.models import ObjectOperation, StoragePool, UseRight, Volume, Workspace


@dataclass(frozen=True)
class Room:
    """One pool's capacity (None = not set) and what is reserved in it."""

    pool_id: str
    capacity_bytes: int | None
    reserved_bytes: int


def reserved_bytes(session: Session, pool_id: str) -> int:
    """The sum of the capacities of the objects in the pool (every object not deleted):
    an indexed sum over the pool's Workspaces (``ix_workspaces_layer_pool_state``)."""
    return _room_row(session, pool_id)[1]


def _room_row(session: Session, pool_id: str) -> tuple[int | None, int]:
    """The pool's capacity and reservations.  One statement when no object operation
    reserves room anywhere (the usual case, and every create reads it twice): the
    capacity, the layers' sum and the Volumes' sum as scalar subqueries, beside whether
    any operation is running.  With one, the Volume half is `volume_pools`' own."""
    row = session.execute(_ROOM, {"pool_id": pool_id}).one()
    capacity, layers, volumes, busy = row[0], row[1], row[2], row[3]
    if busy:
        volumes = volume_pools.reserved_bytes(session, pool_id)
    return capacity, int(layers or 0) + int(volumes or 0)


def _room_statement() -> Select[Any]:
    pool: BindParameter[str] = bindparam("pool_id")
    layers = (select(func.coalesce(func.sum(Workspace.layer_size_bytes), 0))
              .where(Workspace.layer_pool_id == pool, Workspace.state != w.DELETED)
              .scalar_subquery())
    volumes = (select(func.coalesce(func.sum(Volume.capacity_bytes), 0))
               .where(Volume.pool_id == pool, Volume.state != volume_pools.DELETED)
               .scalar_subquery())
    capacity = (select(StoragePool.capacity_bytes).where(StoragePool.pool_id == pool)
                .scalar_subquery())
    busy = exists().where(ObjectOperation.status.in_(volume_pools.RESERVING))
    return select(capacity, layers, volumes, busy)


#: The pool row's capacity, locked: a plain row, as every create reads it.
_POOL_FOR_UPDATE = (select(StoragePool.capacity_bytes)
                    .where(StoragePool.pool_id == bindparam("pool_id")).with_for_update())

#: Built once: a create runs it twice, and building a statement costs more than SQLite
#: takes to answer it.
_ROOM = _room_statement()


def objects(session: Session, pool_id: str) -> list[dict[str, Any]]:
    """The objects in the pool, retained layers first, each with its capacity, the
    Workspace it belongs to and its use right (holder node, epoch)."""
    rows = session.execute(
        select(Workspace, UseRight)
        .outerjoin(UseRight, (UseRight.object_kind == use_rights.RETAINED_LAYER)
                   & (UseRight.object_id == Workspace.layer_ref))
        .where(Workspace.layer_pool_id == pool_id, Workspace.state != w.DELETED)
        .order_by(Workspace.layer_ref)).all()
    out = []
    for ws, right in rows:
        out.append({
            "kind": use_rights.RETAINED_LAYER, "object_id": ws.layer_ref,
            "pool_id": pool_id, "capacity_bytes": ws.layer_size_bytes,
            "workspace_id": ws.workspace_id, "workspace_state": ws.state,
            "holder_node_id": right.holder_node_id if right is not None else None,
            "last_holder_node_id": right.last_holder_node_id if right is not None else None,
            "epoch": right.epoch if right is not None else None})
    return out + volume_pools.objects(session, pool_id)


def room(session: Session, pool_id: str) -> Room:
    """One pool's room, read before its node is asked (not binding): the pool's own
    objects only, so the read does not grow with the cluster."""
    capacity, reserved = _room_row(session, pool_id)
    return Room(pool_id, capacity, reserved)


def snapshot(session: Session) -> dict[str, Room]:
    """Every known pool's room (the metrics' view).  Three queries whatever the number
    of pools (each node has its own default pool), not a query per pool."""
    layers = dict(session.execute(
        select(Workspace.layer_pool_id, func.sum(Workspace.layer_size_bytes))
        .where(Workspace.state != w.DELETED).group_by(Workspace.layer_pool_id)).all())
    others = volume_pools.reserved_by_pool(session)
    return {pool_id: Room(pool_id, capacity,
                          int(layers.get(pool_id) or 0) + others.get(pool_id, 0))
            for pool_id, capacity in session.execute(
                select(StoragePool.pool_id, StoragePool.capacity_bytes)).all()}


def check_snapshot(seen: Room, add_bytes: int, what: str,
                   default_capacity: int | None = None) -> None:
    """The check of `check_room` against a `room` read before: refuse early, write
    nothing."""
    capacity = seen.capacity_bytes
    _verdict(seen.pool_id, capacity if capacity is not None else default_capacity,
             seen.reserved_bytes, add_bytes, what)


def check_room(session: Session, pool_id: str, add_bytes: int, what: str, now: datetime,
               default_capacity: int | None = None) -> None:
    """Refuse (``resource_exhausted``) an object of `add_bytes` in `pool_id` when the
    pool's capacity is not set or the reservations would exceed it.  Call it in the
    transaction that records the object, before the object's row is added: the pool
    row is locked, so creates in one pool are decided one at a time.

    `default_capacity` is ctrl's ``[testing] pool_capacity``: a pool with no capacity
    gets it, recorded as if the operator had set it."""
    locked = session.execute(_POOL_FOR_UPDATE, {"pool_id": pool_id}).first()
    capacity = locked[0] if locked is not None else None
    if capacity is None and default_capacity is not None and locked is not None:
        row = session.get(StoragePool, pool_id, with_for_update=True)
        assert row is not None
        row.capacity_bytes = capacity = default_capacity
        row.revision += 1
        row.updated_at = now
        nodes.record_event(session, now, pool_id, "storage_pool.capacity_set",
                           {"capacity_bytes": default_capacity,
                            "cause": "ctrl [testing] pool_capacity"})
    _verdict(pool_id, capacity, reserved_bytes(session, pool_id), add_bytes, what)


def _verdict(pool_id: str, capacity: int | None, reserved: int, add_bytes: int,
             what: str) -> None:
    if capacity is None:
        raise ResourceExhausted(
            f"storage pool {pool_id} has no capacity set, so no {what} can be created "
            f"in it: set it with `kibo storage-pool set-capacity {pool_id} <SIZE>`",
            details={"pool_id": pool_id, "reason": "capacity_not_set"})
    if reserved + add_bytes > capacity:
        free = max(capacity - reserved, 0)
        raise ResourceExhausted(
            f"storage pool {pool_id} has {format_bytes(free)} left (capacity "
            f"{format_bytes(capacity)}, {format_bytes(reserved)} reserved): a {what} of "
            f"{format_bytes(add_bytes)} does not fit; raise it with `kibo storage-pool "
            f"set-capacity {pool_id} <SIZE>` or delete objects in it",
            details={"pool_id": pool_id, "reason": "capacity_exceeded",
                     "capacity_bytes": capacity, "reserved_bytes": reserved,
                     "requested_bytes": add_bytes})
