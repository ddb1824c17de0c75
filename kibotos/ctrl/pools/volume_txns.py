"""The store side of Volumes: their rows, states and JSON, and the transactions of
create, delete, attach and detach (docs/storage.md, "Volumes").

States::

    CREATING ──► AVAILABLE ──► DELETING ──► DELETED
        └──► FAILED ──────────────┘

A create is recorded first (CREATING, with its use right granted to the node that
makes the block file) and finished by a background task, as Workspace stops are, so a
ctrl restart or a lost session never leaves a block file ctrl does not know.  A Volume
is attached to at most one Workspace: its `use_rights` row then names that Workspace,
so the Workspace's start finds it beside the writable layer (and placement requires its
pool).  Each function runs inside one store transaction.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.core.errors import FailedPrecondition, check_expected_version
from kibotos.ctrl.model import instances as inst_mod
from kibotos.ctrl.model import workspace_records as w
from kibotos.ctrl.model.nodes import record_event, record_transition
from kibotos.ctrl.model.page_tokens import decode_token, encode_token
from kibotos.ctrl.model.workspace_txns import RightPlan
from kibotos.ctrl.pools import capacity as pool_capacity
from kibotos.ctrl.pools import use_rights
from kibotos.ctrl.store.models import ObjectOperation, UseRight, Volume, Workspace, existing
from kibotos.ctrl.wire.base import iso

CREATING = "CREATING"
AVAILABLE = "AVAILABLE"
FAILED = "FAILED"
DELETING = "DELETING"
DELETED = "DELETED"
#: States nothing happens in until someone acts (no operation running either).
SETTLED = frozenset({AVAILABLE, FAILED, DELETED})
#: The use right of a detached Volume names no Workspace.
DETACHED = ""

RUNNING = "running"
CLEANUP = "cleanup"
OP_FAILED = "failed"
BUSY = (RUNNING, CLEANUP)


# ------------------------------------------------------------------------ rendering


def operation_json(op: ObjectOperation | None) -> dict[str, Any] | None:
    if op is None:
        return None
    return {"op": op.op, "status": op.status, "pool_id": op.pool_id,
            "target_pool_id": op.target_pool_id,
            "target_capacity_bytes": op.target_capacity_bytes, "node_id": op.node_id,
            "error": op.error, "started_at": iso(op.created_at),
            "updated_at": iso(op.updated_at)}


def volume_json(session: Session, vol: Volume) -> dict[str, Any]:
    right = session.get(UseRight, (use_rights.VOLUME, vol.volume_id))
    op = session.get(ObjectOperation, (use_rights.VOLUME, vol.volume_id))
    return {
        "volume_id": vol.volume_id, "pool_id": vol.pool_id,
        "capacity_bytes": vol.capacity_bytes, "state": vol.state, "reason": vol.reason,
        "labels": dict(vol.labels), "workspace_id": vol.workspace_id,
        "mount_point": vol.mount_point,
        "holder_node_id": right.holder_node_id if right is not None else None,
        "epoch": right.epoch if right is not None else None, "handoff": vol.handoff,
        "operation": operation_json(op), "revision": vol.revision,
        "created_at": iso(vol.created_at), "updated_at": iso(vol.updated_at),
        "deleted_at": iso(vol.deleted_at),
    }


# ------------------------------------------------------------------------ reads


def get_volume(session: Session, volume_id: str, *, for_update: bool = False) -> Volume:
    return existing(session, Volume, volume_id, "volume", "volume_id", for_update=for_update)


def get_json(session: Session, volume_id: str) -> dict[str, Any]:
    return volume_json(session, get_volume(session, volume_id))


def check_revision(vol: Volume, expected: int | None) -> None:
    check_expected_version("volume", "volume_id", vol.volume_id, vol.revision, expected)


def list_page(session: Session, *, pool_id: str | None, workspace_id: str | None,
              deleted: bool, page_size: int, page_token: str | None
              ) -> dict[str, Any]:
    """Volumes in ID order (keyset paging); DELETED ones only with `deleted`."""
    query = select(Volume).order_by(Volume.volume_id).limit(page_size + 1)
    if not deleted:
        query = query.where(Volume.state != DELETED)
    if pool_id is not None:
        query = query.where(Volume.pool_id == pool_id)
    if workspace_id is not None:
        query = query.where(Volume.workspace_id == workspace_id)
    if page_token:
        query = query.where(Volume.volume_id > decode_token(page_token))
    rows = list(session.scalars(query))
    token = None
    if len(rows) > page_size:
        rows = rows[:page_size]
        token = encode_token(rows[-1].volume_id)
    return {"volumes": [volume_json(session, v) for v in rows], "next_page_token": token}


def pending(session: Session) -> list[tuple[str, str]]:
    """(volume_id, state) of every Volume a background task must finish."""
    rows = session.execute(select(Volume.volume_id, Volume.state)
                           .where(Volume.state.in_((CREATING, DELETING))))
    return [(str(i), str(s)) for i, s in rows]


# ------------------------------------------------------------------------ create


def begin_create(session: Session, *, volume_id: str, pool_id: str, shared: bool,
                 capacity_bytes: int, labels: dict[str, str], node_id: str,
                 now: datetime, default_capacity: int | None = None) -> dict[str, Any]:
    """Check the pool's capacity, record the Volume (CREATING) and grant its use right
    to the node that will make the block file."""
    pool_capacity.check_room(session, pool_id, capacity_bytes, "Volume", now,
                             default_capacity)
    vol = Volume(volume_id=volume_id, pool_id=pool_id, capacity_bytes=capacity_bytes,
                 state=CREATING, reason=None, labels=labels, workspace_id=None,
                 mount_point=None, revision=1, created_at=now, updated_at=now,
                 deleted_at=None)
    right = use_rights.new_right(kind=use_rights.VOLUME, object_id=volume_id,
                                 workspace_id=DETACHED, pool_id=pool_id, shared=shared,
                                 now=now)
    use_rights.grant(right, node_id, now)
    session.add_all([vol, right])
    session.flush()
    record_event(session, now, volume_id, "transition",
                 {"from": None, "to": CREATING, "cause": f"create on node {node_id}"})
    return volume_json(session, vol)


def _transition(session: Session, vol: Volume, to: str, cause: str, now: datetime, *,
                reason: str | None = None) -> None:
    record_transition(session, vol.volume_id, vol, to, cause, now, reason=reason)


def create_target(session: Session, volume_id: str) -> tuple[str, str, int, int] | None:
    """(node, pool, capacity, epoch) a CREATING Volume is being made with."""
    vol = session.get(Volume, volume_id)
    right = session.get(UseRight, (use_rights.VOLUME, volume_id))
    if vol is None or vol.state != CREATING or right is None:
        return None
    node = right.holder_node_id or right.last_holder_node_id
    if node is None:
        return None
    return node, vol.pool_id, vol.capacity_bytes, right.epoch


def create_done(session: Session, volume_id: str, node_id: str, now: datetime) -> None:
    vol = session.get(Volume, volume_id, with_for_update=True)
    if vol is None or vol.state != CREATING:
        return
    right = session.get(UseRight, (use_rights.VOLUME, volume_id), with_for_update=True)
    if right is not None:
        use_rights.release_after_stop(right, now)
    _transition(session, vol, AVAILABLE, f"node {node_id} created the block file", now)


def create_failed(session: Session, volume_id: str, message: str, now: datetime) -> None:
    vol = session.get(Volume, volume_id, with_for_update=True)
    if vol is None or vol.state != CREATING:
        return
    _transition(session, vol, FAILED, "the node could not create the block file", now,
                reason=message)


# ------------------------------------------------------------------------ delete


def attached_workspace(session: Session, vol: Volume, *,
                       for_update: bool = False) -> Workspace | None:
    """The Workspace the Volume is attached to, unless that one is DELETED."""
    if not vol.workspace_id:
        return None
    ws = session.get(Workspace, vol.workspace_id, with_for_update=for_update)
    return ws if ws is not None and ws.state != w.DELETED else None


def busy_operation(session: Session, kind: str, object_id: str) -> ObjectOperation | None:
    op = session.get(ObjectOperation, (kind, object_id))
    return op if op is not None and op.status in BUSY else None


def begin_delete(session: Session, volume_id: str, expected: int | None,
                 now: datetime) -> dict[str, Any]:
    vol = get_volume(session, volume_id, for_update=True)
    check_revision(vol, expected)
    if vol.state in (DELETING, DELETED):
        return volume_json(session, vol)
    ws = attached_workspace(session, vol)
    if ws is not None:
        raise FailedPrecondition(
            f"volume {volume_id} is attached to workspace {ws.workspace_id} "
            f"({ws.state}): delete the Workspace first",
            details={"volume_id": volume_id, "workspace_id": ws.workspace_id})
    if vol.state == CREATING:
        raise FailedPrecondition(f"volume {volume_id} is still CREATING: wait for it",
                                 details={"volume_id": volume_id, "state": vol.state})
    op = busy_operation(session, use_rights.VOLUME, volume_id)
    if op is not None:
        raise FailedPrecondition(
            f"volume {volume_id} is being {'expanded' if op.op == 'expand' else 'moved'}: "
            "wait for it to finish", details={"volume_id": volume_id, "operation": op.op})
    _transition(session, vol, DELETING, "delete", now)
    return volume_json(session, vol)


def delete_plan(session: Session, volume_id: str) -> RightPlan | None:
    """The use right of a DELETING Volume (None: nothing left to do)."""
    vol = session.get(Volume, volume_id)
    right = session.get(UseRight, (use_rights.VOLUME, volume_id))
    if vol is None or vol.state != DELETING or right is None:
        return None
    return RightPlan(right.object_kind, right.object_id, right.pool_id, right.pool_shared,
                     right.holder_node_id, right.last_holder_node_id, right.epoch,
                     right.bump_on_grant)


def delete_done(session: Session, volume_id: str, now: datetime) -> None:
    vol = session.get(Volume, volume_id, with_for_update=True)
    if vol is None or vol.state != DELETING:
        return
    right = session.get(UseRight, (use_rights.VOLUME, volume_id), with_for_update=True)
    if right is not None:
        session.delete(right)
    op = session.get(ObjectOperation, (use_rights.VOLUME, volume_id), with_for_update=True)
    if op is not None:
        session.delete(op)
    vol.deleted_at = now
    _transition(session, vol, DELETED, "delete finished", now)


def workspace_stopped(session: Session, ws: Workspace) -> None:
    """Expansions and moves need the Workspace stopped: nothing holds its objects."""
    if ws.state not in (w.STOPPED, w.FAILED) or inst_mod.holds_allocation(
            session, ws.current_instance_id):
        raise FailedPrecondition(
            f"workspace {ws.workspace_id} is {ws.state}"
            + (" and its Instance still holds its objects" if ws.state == w.FAILED else "")
            + f": stop it first (`kibo workspace stop {ws.workspace_id}`)",
            details={"workspace_id": ws.workspace_id, "state": ws.state})
