"""What Volumes and object operations take of a storage pool: the Volume half of
`kibotos.ctrl.pool_capacity` (which adds the writable layers), kept apart so that
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

from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.ctrl import use_rights
from kibotos.ctrl.store.models import ObjectOperation, UseRight, Volume

DELETED = "DELETED"
#: Operation statuses that still reserve room.
RESERVING = ("running", "cleanup", "failed")


def _ops(session: Session) -> dict[tuple[str, str], ObjectOperation]:
    return {(o.object_kind, o.object_id): o for o in session.scalars(
        select(ObjectOperation).where(ObjectOperation.status.in_(RESERVING)))}


def reserved_bytes(session: Session, pool_id: str) -> int:
    """Bytes of `pool_id` reserved by Volumes and by operations on pool objects."""
    total = 0
    ops = _ops(session)
    for vol in session.scalars(select(Volume).where(Volume.pool_id == pool_id,
                                                    Volume.state != DELETED)):
        op = ops.get((use_rights.VOLUME, vol.volume_id))
        target = op.target_capacity_bytes if op is not None and op.op == "expand" else None
        total += max(vol.capacity_bytes, target or 0)
    for op in ops.values():
        if op.op == "move" and op.status == "running" and op.target_pool_id == pool_id:
            total += op.capacity_bytes
        elif (op.op == "expand" and op.object_kind == use_rights.RETAINED_LAYER
              and op.pool_id == pool_id and op.target_capacity_bytes):
            total += max(0, op.target_capacity_bytes - op.capacity_bytes)
    return total


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
