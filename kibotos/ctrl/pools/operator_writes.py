"""The operator's writes on storage pools: set the capacity, declare a pool lost.

``set-capacity`` is the only way a pool gets a capacity (spec: storage-pools-on-nfs,
"Pool capacity"); it never goes below what is already reserved, since those objects
exist and keep their size.

``declare-lost`` is the operator's assertion that a pool's storage is gone for good
(spec/nodes.txt, "retire": "The disk is gone too: use kibo storage-pool
declare-lost").  Like isolate, ctrl cannot verify it, so it needs an explicit
confirmation, and it is refused while the pool has a member: a member node may still
reach the storage (retire or revoke it first; if the disk is intact, move the pool to
another host instead).  What it does, in one transaction:

* the pool is marked lost (``lost_at``, the lost marker ``instance``), and its
  registration is dropped;
* every Workspace whose writable layer is in the pool and that is STOPPED or FAILED
  becomes FAILED with a reason saying its layer is gone: it cannot start again, only
  be deleted; use rights on the lost objects are released;
* the writable layers of Workspaces being deleted are forgotten (their use rights
  removed), so those deletes finish without a node; later deletes do the same
  (`forget_lost_object`, called by the delete task when no node can reach the pool).
  Volumes in the pool keep their rows (the Volumes code owns them); a Workspace with
  an object in a lost pool is refused at start (`refuse_lost`).

A node that later declares the pool ID again (another storage, or the disk found after
all) registers it anew and clears the lost state; the Workspaces stay FAILED.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.core.errors import FailedPrecondition, NotFound, check_expected_version
from kibotos.core.units import format_bytes
from kibotos.ctrl.model import nodes
from kibotos.ctrl.model import workspace_records as w
from kibotos.ctrl.pools import capacity as pool_capacity
from kibotos.ctrl.pools import facts as pool_facts
from kibotos.ctrl.pools import use_rights
from kibotos.ctrl.pools import view as pool_view
from kibotos.ctrl.store.models import StoragePool, UseRight, Workspace

#: Workspace states in which something may still run on a node.
_EXECUTING = (w.CREATING, w.STARTING, w.AVAILABLE, w.STOPPING)


def lost_reason(pool_id: str) -> str:
    return (f"storage pool {pool_id} was declared lost: the writable layer is gone; "
            "the Workspace can only be deleted")


def _row(session: Session, pool_id: str, now: datetime) -> StoragePool:
    row = session.get(StoragePool, pool_id, with_for_update=True)
    if row is None and pool_id in pool_view.member_entries(session):
        # declared by a node whose facts were stored before ctrl kept pool rows
        row = pool_facts.ensure_row(session, pool_id, now)
    if row is None:
        raise NotFound(f"storage pool {pool_id} does not exist: no node has declared it",
                       details={"pool_id": pool_id})
    return row


def _check_revision(row: StoragePool, expected: int | None) -> None:
    check_expected_version("storage pool", "pool_id", row.pool_id, row.revision, expected)


def set_capacity(session: Session, pool_id: str, capacity_bytes: int, expected: int | None,
                 now: datetime) -> dict[str, Any]:
    row = _row(session, pool_id, now)
    _check_revision(row, expected)
    if row.lost_at is not None:
        raise FailedPrecondition(
            f"storage pool {pool_id} was declared lost; a node must declare it again "
            "before it gets a capacity", details={"pool_id": pool_id})
    reserved = pool_capacity.reserved_bytes(session, pool_id)
    if capacity_bytes < reserved:
        raise FailedPrecondition(
            f"capacity {format_bytes(capacity_bytes)} is below the "
            f"{format_bytes(reserved)} already reserved by the objects in storage pool "
            f"{pool_id} (`kibo storage-pool objects {pool_id}` lists them)",
            details={"pool_id": pool_id, "capacity_bytes": capacity_bytes,
                     "reserved_bytes": reserved})
    if row.capacity_bytes != capacity_bytes:
        nodes.record_event(session, now, pool_id, "storage_pool.capacity_set",
                           {"capacity_bytes": capacity_bytes,
                            "previous_bytes": row.capacity_bytes})
        row.capacity_bytes = capacity_bytes
        row.revision += 1
        row.updated_at = now
    session.flush()
    return pool_view.get_pool(session, pool_id)


def declare_lost(session: Session, pool_id: str, expected: int | None, now: datetime
                 ) -> dict[str, Any]:
    row = _row(session, pool_id, now)
    _check_revision(row, expected)
    if row.lost_at is not None:
        raise FailedPrecondition(f"storage pool {pool_id} was already declared lost",
                                 details={"pool_id": pool_id})
    view = pool_view.get_pool(session, pool_id)
    if view["members"]:
        names = ", ".join(f"{m['node_id']} ({m['node_status']})" for m in view["members"])
        raise FailedPrecondition(
            f"storage pool {pool_id} still has member nodes: {names}. A member may still "
            "reach the storage: retire or revoke it first (if the disk is intact, attach "
            "it to another host and declare the same pool ID instead)",
            details={"pool_id": pool_id,
                     "members": [m["node_id"] for m in view["members"]]})
    workspaces = session.scalars(
        select(Workspace).where(Workspace.layer_pool_id == pool_id,
                                Workspace.state != w.DELETED)
        .order_by(Workspace.workspace_id).with_for_update()).all()
    running = [ws.workspace_id for ws in workspaces if ws.state in _EXECUTING]
    if running:
        raise FailedPrecondition(
            f"storage pool {pool_id} has Workspaces that are not stopped: "
            f"{', '.join(running)}", details={"pool_id": pool_id, "workspaces": running})
    failed, forgotten = [], 0
    for ws in workspaces:
        if ws.state == w.DELETING:
            continue
        if ws.state != w.FAILED or ws.reason != lost_reason(pool_id):
            w.clear_executing(ws)
            w.transition(session, ws, w.FAILED, f"storage pool {pool_id} declared lost",
                         now, reason=lost_reason(pool_id))
            failed.append(ws.workspace_id)
    for right in session.scalars(select(UseRight).where(UseRight.pool_id == pool_id)
                                 .with_for_update()):
        owner = next((ws for ws in workspaces if ws.workspace_id == right.workspace_id),
                     None)
        if (owner is not None and owner.state == w.DELETING
                and right.object_kind == use_rights.RETAINED_LAYER):
            # (a Volume outlives its Workspace: the Volumes code detaches it)
            session.delete(right)
            forgotten += 1
        elif right.holder_node_id is not None:
            right.holder_node_id = None
            right.bump_on_grant = True
            right.updated_at = now
    nodes.record_event(session, now, pool_id, "storage_pool.lost",
                       {"instance": row.instance, "failed_workspaces": failed,
                        "forgotten_objects": forgotten})
    row.lost_at = now
    row.lost_instance = row.instance
    row.instance = None
    row.registered_node_id = None
    row.revision += 1
    row.updated_at = now
    session.flush()
    return {"pool": pool_view.get_pool(session, pool_id), "failed_workspaces": failed,
            "forgotten_objects": forgotten}


def refuse_lost(session: Session, workspace_id: str, pool_ids: set[str]) -> None:
    """A Workspace with an object in a lost pool cannot start: say so, rather than
    "no node can take it"."""
    lost = session.scalars(select(StoragePool).where(StoragePool.pool_id.in_(pool_ids),
                                                     StoragePool.lost_at.is_not(None))
                           .order_by(StoragePool.pool_id)).first()
    if lost is not None:
        raise FailedPrecondition(
            f"workspace {workspace_id} cannot start: storage pool {lost.pool_id} was "
            "declared lost and its objects are gone; delete the Workspace",
            details={"workspace_id": workspace_id, "pool_id": lost.pool_id})


def forget_lost_object(session: Session, kind: str, object_id: str) -> bool:
    """Drop the use right of an object whose pool was declared lost (nothing is left
    on any node to delete); False when its pool is not lost."""
    right = session.get(UseRight, (kind, object_id), with_for_update=True)
    if right is None:
        return True
    pool = session.get(StoragePool, right.pool_id)
    if pool is None or pool.lost_at is None:
        return False
    session.delete(right)
    return True
