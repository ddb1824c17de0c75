"""The store transactions of Transfers (docs/storage.md, "Transfer"), for
`kibotos.ctrl.live.transfer_service`: whether a Volume may be exported now, the grant
of its use right to the exporting node and its release, and the record of an imported
Volume.  Each function runs inside one store transaction.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from kibotos.core.errors import FailedPrecondition
from kibotos.ctrl.model.nodes import record_event
from kibotos.ctrl.pools import use_rights
from kibotos.ctrl.pools import volume_txns as vt
from kibotos.ctrl.store.models import UseRight, Volume


def _exportable(session: Session, volume_id: str) -> tuple[UseRight, int]:
    """The Volume's use right, after checking it may be exported now; and capacity."""
    vol = vt.get_volume(session, volume_id)
    if vol.state != vt.AVAILABLE:
        raise FailedPrecondition(f"volume {volume_id} is {vol.state}, not AVAILABLE",
                                 details={"volume_id": volume_id, "state": vol.state})
    ws = vt.attached_workspace(session, vol)
    if ws is not None:
        vt.workspace_stopped(session, ws)
    op = vt.busy_operation(session, use_rights.VOLUME, volume_id)
    if op is not None:
        raise FailedPrecondition(
            f"volume {volume_id} is being {'expanded' if op.op == 'expand' else 'moved'}: "
            "export it once that is done",
            details={"volume_id": volume_id, "operation": op.op})
    right = session.get(UseRight, (use_rights.VOLUME, volume_id))
    if right is None:
        raise FailedPrecondition(f"volume {volume_id} has no use right record",
                                 details={"volume_id": volume_id})
    return right, vol.capacity_bytes


def export_plan(session: Session, volume_id: str) -> tuple[str, str | None, str | None]:
    """(pool, holder, last holder) of an exportable Volume."""
    right, _ = _exportable(session, volume_id)
    return right.pool_id, right.holder_node_id, right.last_holder_node_id


def grant_for_export(session: Session, volume_id: str, node_id: str, now: datetime
                     ) -> tuple[int, int]:
    """Check again and grant the use right to the exporting node: (epoch, capacity)."""
    right, capacity = _exportable(session, volume_id)
    right = session.get(UseRight, (use_rights.VOLUME, volume_id), with_for_update=True) \
        or right
    return use_rights.grant(right, node_id, now), capacity


def release_export(session: Session, *, volume_id: str, node_id: str, epoch: int,
                   now: datetime) -> None:
    """The export is over (done or not): as after a stop, a shared pool's object is held
    by nobody again; a private pool's node keeps it."""
    right = session.get(UseRight, (use_rights.VOLUME, volume_id), with_for_update=True)
    if right is not None and right.holder_node_id == node_id and right.epoch == epoch:
        use_rights.release_after_stop(right, now)


def export_done(session: Session, *, result: dict[str, Any], now: datetime
                ) -> dict[str, Any]:
    release_export(session, volume_id=result["volume_id"], node_id=result["node_id"],
                   epoch=result["epoch"], now=now)
    record_event(session, now, result["volume_id"], "transfer.exported",
                 {"artifact_digest": result["artifact_digest"], "size": result["size"],
                  "node_id": result["node_id"], "epoch": result["epoch"]})
    return result


def volume_exists(session: Session, volume_id: str) -> bool:
    return session.get(Volume, volume_id) is not None


def record_import(session: Session, *, volume_id: str, pool_id: str, shared: bool,
                  capacity_bytes: int, labels: dict[str, str], node_id: str,
                  digest: str, source: str, now: datetime, default_capacity: int | None
                  ) -> dict[str, Any]:
    """The imported Volume, AVAILABLE, its use right at the epoch the node wrote."""
    vt.begin_create(session, volume_id=volume_id, pool_id=pool_id, shared=shared,
                    capacity_bytes=capacity_bytes, labels=labels, node_id=node_id, now=now,
                    default_capacity=default_capacity)
    vt.create_done(session, volume_id=volume_id, node_id=node_id, now=now)
    record_event(session, now, volume_id, "transfer.imported",
                 {"artifact_digest": digest, "node_id": node_id, "source": source})
    volume = vt.get_json(session, volume_id)
    return {"volume": volume, "artifact_digest": digest, "node_id": node_id,
            "source_volume_id": source}

