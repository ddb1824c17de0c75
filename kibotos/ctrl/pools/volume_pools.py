"""What Volumes and object operations take of a storage pool: the Volume half of
`kibotos.ctrl.pools.capacity` (which adds the writable layers), kept apart so that
module and the Volume code do not import each other.

Reservations are whole capacities (spec: storage-pools-on-nfs, "Pool capacity"): a
Volume reserves the larger of its capacity and the target of an expansion that is
running or failed (the next one may not go below it); an object being moved reserves
its capacity in the target pool too until the move is done; a writable layer being
expanded reserves the difference to its target (its own capacity is counted with its
Workspace).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Row, select
from sqlalchemy.orm import Session

from kibotos.ctrl.pools import use_rights
from kibotos.ctrl.store.models import ObjectOperation, UseRight, Volume

DELETED = "DELETED"
#: Operation statuses that still reserve room.
RESERVING = ("running", "cleanup", "failed")


def _ops(session: Session) -> dict[tuple[str, str], Row[Any]]:
    """The operations that still reserve room, as plain rows (Core, not ORM objects: a
    create reads them every time, and there are usually none)."""
    o = ObjectOperation
    rows: list[Row[Any]] = list(session.execute(
        select(o.object_kind, o.object_id, o.op, o.status, o.pool_id, o.target_pool_id,
               o.capacity_bytes, o.target_capacity_bytes)
        .where(o.status.in_(RESERVING))))
    return {(r.object_kind, r.object_id): r for r in rows}


def reserved_bytes(session: Session, pool_id: str) -> int:
    """Bytes of `pool_id` reserved by Volumes and by operations on pool objects."""
    return reserved_by_pool(session, pool_id).get(pool_id, 0)


def reserved_by_pool(session: Session, pool_id: str | None = None) -> dict[str, int]:
    """`reserved_bytes` of every pool (or only `pool_id`), in one pass over the
    Volumes and one over the operations: a create's capacity snapshot reads every pool,
    and a query per pool made that cost grow with the number of nodes."""
    totals: dict[str, int] = {}

    def add(pool: str | None, amount: int) -> None:
        if pool is not None and (pool_id is None or pool == pool_id):
            totals[pool] = totals.get(pool, 0) + amount

    ops = _ops(session)
    volumes = select(Volume.volume_id, Volume.pool_id, Volume.capacity_bytes).where(
        Volume.state != DELETED)
    if pool_id is not None:
        volumes = volumes.where(Volume.pool_id == pool_id)
    for vol in session.execute(volumes):
        op = ops.get((use_rights.VOLUME, vol.volume_id))
        target = op.target_capacity_bytes if op is not None and op.op == "expand" else None
        add(vol.pool_id, max(vol.capacity_bytes, target or 0))
    for op in ops.values():
        if op.op == "move" and op.status == "running":
            add(op.target_pool_id, op.capacity_bytes)
        elif (op.op == "expand" and op.object_kind == use_rights.RETAINED_LAYER
              and op.target_capacity_bytes):
            add(op.pool_id, max(0, op.target_capacity_bytes - op.capacity_bytes))
    return totals


def objects(session: Session, pool_id: str) -> list[dict[str, Any]]:
    """The Volumes in a pool, in the shape of `pool_capacity.objects`."""
    rows = session.execute(
        select(Volume, UseRight)
        .outerjoin(UseRight, (UseRight.object_kind == use_rights.VOLUME)
                   & (UseRight.object_id == Volume.volume_id))
        .where(Volume.pool_id == pool_id, Volume.state != DELETED)
        .order_by(Volume.volume_id)).all()
    return [{"kind": use_rights.VOLUME, "object_id": vol.volume_id, "pool_id": pool_id,
             "capacity_bytes": vol.capacity_bytes, "workspace_id": vol.workspace_id,
             "workspace_state": None,
             "holder_node_id": right.holder_node_id if right is not None else None,
             "last_holder_node_id": right.last_holder_node_id if right is not None else None,
             "epoch": right.epoch if right is not None else None}
            for vol, right in rows]
