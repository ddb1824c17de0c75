"""Volumes and their Workspace: attaching at Workspace create, the Volumes' part of a
start (mount points; refused while an object is being expanded or copied), detaching
at Workspace delete (docs/storage.md, "Volumes in ctrl").

`workspace_ops` and `workspace_tasks` call these instead of the plain `workspace_txns`
functions they wrap, so the Workspace transactions need not know about Volumes.  Each
function runs inside one store transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.core.errors import FailedPrecondition
from kibotos.ctrl.model import workspace_txns as tx
from kibotos.ctrl.model.nodes import record_event
from kibotos.ctrl.model.workspace_txns import RightPlan, Stale
from kibotos.ctrl.pools import use_rights
from kibotos.ctrl.pools.volume_txns import (
    AVAILABLE,
    DETACHED,
    RUNNING,
    attached_workspace,
    busy_operation,
    get_volume,
)
from kibotos.ctrl.store.models import ObjectOperation, UseRight, Volume

# ------------------------------------------------------------------------ attach, detach


@dataclass(frozen=True)
class AttachPlan:
    """One Volume a Workspace create attaches, as read before placement."""

    volume_id: str
    mount_point: str
    right: RightPlan


def _attachable(session: Session, vol: Volume) -> None:
    if vol.state != AVAILABLE:
        raise FailedPrecondition(f"volume {vol.volume_id} is {vol.state}, not AVAILABLE",
                                 details={"volume_id": vol.volume_id, "state": vol.state})
    ws = attached_workspace(session, vol)
    if ws is not None:
        raise FailedPrecondition(
            f"volume {vol.volume_id} is attached to workspace {ws.workspace_id}",
            details={"volume_id": vol.volume_id, "workspace_id": ws.workspace_id})
    if busy_operation(session, use_rights.VOLUME, vol.volume_id) is not None:
        raise FailedPrecondition(f"volume {vol.volume_id} is being expanded or moved",
                                 details={"volume_id": vol.volume_id})


def _right_plan(right: UseRight) -> RightPlan:
    return RightPlan(right.object_kind, right.object_id, right.pool_id, right.pool_shared,
                     right.holder_node_id, right.last_holder_node_id, right.epoch,
                     right.bump_on_grant)


def attach_plans(session: Session, wanted: Sequence[tuple[str, str]]) -> list[AttachPlan]:
    """Check (volume_id, mount_point) pairs of a create: each Volume exists, is
    AVAILABLE, attached to no live Workspace and not busy."""
    plans = []
    for volume_id, mount in wanted:
        vol = get_volume(session, volume_id)
        _attachable(session, vol)
        right = session.get(UseRight, (use_rights.VOLUME, volume_id))
        if right is None:
            raise FailedPrecondition(f"volume {volume_id} has no use right record",
                                     details={"volume_id": volume_id})
        plans.append(AttachPlan(volume_id, mount, _right_plan(right)))
    return plans


def attach(session: Session, plans: Sequence[AttachPlan], workspace_id: str,
           node_id: str, now: datetime) -> None:
    """In the Workspace create's transaction: check again, attach, grant to the node."""
    for plan in plans:
        vol = get_volume(session, plan.volume_id, for_update=True)
        right = session.get(UseRight, (use_rights.VOLUME, plan.volume_id),
                            with_for_update=True)
        try:
            _attachable(session, vol)
        except FailedPrecondition as exc:
            raise Stale(exc.message) from None
        if right is None or _right_plan(right) != plan.right:
            raise Stale(f"volume {plan.volume_id} changed while the Workspace was placed")
        vol.workspace_id = workspace_id
        vol.mount_point = plan.mount_point
        vol.revision += 1
        vol.updated_at = now
        right.workspace_id = workspace_id
        use_rights.grant(right, node_id, now)
        record_event(session, now, plan.volume_id, "attach",
                     {"workspace_id": workspace_id, "mount_point": plan.mount_point})


def detach(session: Session, volume_id: str, now: datetime) -> None:
    """The Workspace is being deleted: the Volume stays, attached to nothing."""
    vol = session.get(Volume, volume_id, with_for_update=True)
    right = session.get(UseRight, (use_rights.VOLUME, volume_id), with_for_update=True)
    if right is not None:
        right.workspace_id = DETACHED
        right.updated_at = now
    if vol is not None and vol.workspace_id is not None:
        record_event(session, now, volume_id, "detach", {"workspace_id": vol.workspace_id})
        vol.workspace_id = None
        vol.mount_point = None
        vol.revision += 1
        vol.updated_at = now


def mounts_of(session: Session, workspace_id: str) -> dict[str, str]:
    """volume_id → guest mount point of the Volumes attached to a Workspace."""
    rows = session.execute(select(Volume.volume_id, Volume.mount_point)
                           .where(Volume.workspace_id == workspace_id))
    return {str(v): str(m) for v, m in rows if m}


def check_startable(session: Session, workspace_id: str) -> None:
    """A Workspace whose writable layer or Volume is being expanded or copied cannot
    start until that is done.  A move whose copy is done (status ``cleanup``: only the
    old copy, in the old pool, is left to delete) does not hold it back."""
    for op in session.scalars(select(ObjectOperation).where(
            ObjectOperation.workspace_id == workspace_id,
            ObjectOperation.status == RUNNING)):
        what = "writable layer" if op.object_kind == use_rights.RETAINED_LAYER \
            else f"volume {op.object_id}"
        raise FailedPrecondition(
            f"the {what} of workspace {workspace_id} is being "
            f"{'expanded' if op.op == 'expand' else 'moved'}: start it once that is done",
            details={"workspace_id": workspace_id, "object_id": op.object_id,
                     "operation": op.op})


# ------------------------------------------------------------------------ Workspace side


def start_plan(session: Session, workspace_id: str, expected: int | None,
               ) -> tuple[tx.StartPlan, dict[str, str]]:
    """`workspace_txns.start_plan`, refused while an object of the Workspace is being
    expanded or moved, with the guest mount point of each attached Volume."""
    plan = tx.start_plan(session, workspace_id, expected)
    check_startable(session, workspace_id)
    return plan, mounts_of(session, workspace_id)


def commit_start(session: Session, **kwargs: Any) -> dict[str, Any]:
    """`workspace_txns.commit_start`, checking again that nothing is being expanded
    or moved (an operation recorded while the Workspace was placed)."""
    plan: tx.StartPlan = kwargs["plan"]
    check_startable(session, plan.workspace_id)
    return tx.commit_start(session, **kwargs)


def commit_create(session: Session, *, plans: Sequence[AttachPlan],
                  **kwargs: Any) -> dict[str, Any]:
    """`workspace_txns.commit_create`, attaching the Volumes in the same transaction."""
    result = tx.commit_create(session, **kwargs)
    attach(session, plans, kwargs["workspace_id"], kwargs["node_id"], kwargs["now"])
    return result
