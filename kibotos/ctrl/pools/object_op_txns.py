"""The store transactions of expansions and moves of pool objects: a Volume
(``volume``, named by its ID) or a Workspace's writable layer (``retained_layer``,
named by the Workspace ID in requests and by its ref on the node).

Each operation is one `ObjectOperation` row, recorded before any node is asked (with
the capacity it needs checked in the same transaction) and finished by
`object_ops.ObjectOps`.  The object's Workspace must be stopped: nothing may hold the
block file while a node runs ``e2fsck``/``resize2fs`` on it or copies it, and a start
is refused while the operation runs (`volume_txns.check_startable`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.ctrl.model import workspace_records as w
from kibotos.ctrl.model.nodes import record_event
from kibotos.ctrl.pools import capacity as pool_capacity
from kibotos.ctrl.pools import use_rights
from kibotos.ctrl.pools import volume_txns as vt
from kibotos.ctrl.store.models import ObjectOperation, UseRight, Volume, Workspace

EXPAND = "expand"
MOVE = "move"
VOLUME = use_rights.VOLUME
LAYER = use_rights.RETAINED_LAYER


@dataclass(frozen=True)
class Subject:
    """The object an operation is about, as the node names it."""

    kind: str
    object_id: str  # volume ID or layer ref
    workspace_id: str | None
    pool_id: str
    capacity_bytes: int


def _subject(session: Session, kind: str, name: str, expected: int | None,
             ) -> tuple[Subject, Volume | None, Workspace | None]:
    """Read (locked) and check the object: it exists and is usable, its Workspace (if
    any) is stopped, and `expected` matches the revision of the Volume (or of the
    Workspace, for its writable layer)."""
    if kind == VOLUME:
        vol = vt.get_volume(session, name, for_update=True)
        vt.check_revision(vol, expected)
        if vol.state != vt.AVAILABLE:
            raise FailedPrecondition(f"volume {name} is {vol.state}, not AVAILABLE",
                                     details={"volume_id": name, "state": vol.state})
        # Locked: a start of that Workspace cannot commit past this check.
        ws = vt.attached_workspace(session, vol, for_update=True)
        if ws is not None:
            vt.workspace_stopped(session, ws)
        return Subject(VOLUME, name, ws.workspace_id if ws else None, vol.pool_id,
                       vol.capacity_bytes), vol, ws
    ws = w.get_workspace(session, name, for_update=True)
    w.check_revision(ws, expected)
    if ws.state in (w.DELETING, w.DELETED):
        raise FailedPrecondition(f"workspace {name} is {ws.state}",
                                 details={"workspace_id": name, "state": ws.state})
    vt.workspace_stopped(session, ws)
    return Subject(LAYER, ws.layer_ref, ws.workspace_id, ws.layer_pool_id,
                   ws.layer_size_bytes), None, ws


def _what(subject: Subject) -> str:
    if subject.kind == VOLUME:
        return f"volume {subject.object_id}"
    return f"the writable layer of workspace {subject.workspace_id}"


def status_json(session: Session, kind: str, name: str) -> dict[str, Any]:
    """The object after a request: the Volume, or the writable layer's status."""
    if kind == VOLUME:
        return vt.get_json(session, name)
    ws = w.get_workspace(session, name)
    op = session.get(ObjectOperation, (LAYER, ws.layer_ref))
    return {"workspace_id": ws.workspace_id, "state": ws.state, "revision": ws.revision,
            "pool_id": ws.layer_pool_id, "ref": ws.layer_ref,
            "size_bytes": ws.layer_size_bytes, "operation": vt.operation_json(op)}


def _existing(session: Session, subject: Subject) -> ObjectOperation | None:
    return session.get(ObjectOperation, (subject.kind, subject.object_id),
                       with_for_update=True)


def _record(session: Session, subject: Subject, op: str, now: datetime, *,
            target_pool_id: str | None = None, target_capacity: int | None = None,
            node_id: str | None = None, old: ObjectOperation | None) -> None:
    if old is not None:
        session.delete(old)
        session.flush()
    session.add(ObjectOperation(
        object_kind=subject.kind, object_id=subject.object_id,
        workspace_id=subject.workspace_id, op=op, status=vt.RUNNING,
        pool_id=subject.pool_id, capacity_bytes=subject.capacity_bytes,
        target_pool_id=target_pool_id, target_capacity_bytes=target_capacity,
        node_id=node_id, epoch=None, error=None, created_at=now, updated_at=now))
    record_event(session, now, subject.object_id, f"{op}.begin",
                 {"kind": subject.kind, "pool_id": subject.pool_id,
                  "target_pool_id": target_pool_id, "target_capacity_bytes": target_capacity,
                  "workspace_id": subject.workspace_id})


def _busy(subject: Subject, old: ObjectOperation | None) -> None:
    if old is not None and old.status in vt.BUSY:
        raise FailedPrecondition(
            f"{_what(subject)} is already being "
            f"{'expanded' if old.op == EXPAND else 'moved'}: wait for it to finish",
            details={"object_id": subject.object_id, "operation": old.op})


def begin_expand(session: Session, *, kind: str, name: str, capacity_bytes: int,
                 expected: int | None, now: datetime,
                 default_capacity: int | None = None) -> dict[str, Any]:
    subject, _, _ = _subject(session, kind, name, expected)
    old = _existing(session, subject)
    _busy(subject, old)
    failed_target = old.target_capacity_bytes if old is not None and old.op == EXPAND \
        else None
    if capacity_bytes < subject.capacity_bytes:
        raise InvalidArgument(
            f"{_what(subject)} has {subject.capacity_bytes} bytes: block files only "
            f"grow, so {capacity_bytes} is too small",
            details={"capacity_bytes": subject.capacity_bytes})
    if failed_target is not None and capacity_bytes < failed_target:
        raise InvalidArgument(
            f"an expansion of {_what(subject)} to {failed_target} bytes did not finish: "
            f"expand again to at least that size (it continues from the block file's "
            f"current state)", details={"target_capacity_bytes": failed_target})
    if capacity_bytes == subject.capacity_bytes:
        return status_json(session, kind, name)  # nothing to do
    if old is not None:
        # A failed expansion's reservation is replaced by this one's.
        session.delete(old)
        session.flush()
        old = None
    pool_capacity.check_room(session, subject.pool_id,
                             capacity_bytes - subject.capacity_bytes, "expansion", now,
                             default_capacity)
    _record(session, subject, EXPAND, now, target_capacity=capacity_bytes, old=old)
    return status_json(session, kind, name)


def begin_move(session: Session, *, kind: str, name: str, pool_id: str, node_id: str,
               expected: int | None, now: datetime,
               default_capacity: int | None = None) -> dict[str, Any]:
    """`node_id` is the node attached to both pools that will copy it (found by the
    caller from the nodes' reports; none is ``failed_precondition``)."""
    subject, _, _ = _subject(session, kind, name, expected)
    if subject.pool_id == pool_id:
        raise FailedPrecondition(f"{_what(subject)} is already in pool {pool_id}",
                                 details={"pool_id": pool_id})
    old = _existing(session, subject)
    _busy(subject, old)
    pool_capacity.check_room(session, pool_id, subject.capacity_bytes, "moved object",
                             now, default_capacity)
    _record(session, subject, MOVE, now, target_pool_id=pool_id, node_id=node_id, old=old)
    return status_json(session, kind, name)


def subject_of(session: Session, kind: str, name: str) -> Subject:
    """The object (not locked, not checked): for choosing a node before the write."""
    if kind == VOLUME:
        vol = vt.get_volume(session, name)
        return Subject(VOLUME, name, vol.workspace_id, vol.pool_id, vol.capacity_bytes)
    ws = w.get_workspace(session, name)
    return Subject(LAYER, ws.layer_ref, ws.workspace_id, ws.layer_pool_id,
                   ws.layer_size_bytes)


# ------------------------------------------------------------------------ finishing


@dataclass(frozen=True)
class OpState:
    kind: str
    object_id: str
    op: str
    status: str
    pool_id: str
    target_pool_id: str | None
    target_capacity_bytes: int | None
    node_id: str | None
    epoch: int | None
    holder_node_id: str | None
    last_holder_node_id: str | None


def pending(session: Session) -> list[tuple[str, str]]:
    rows = session.execute(select(ObjectOperation.object_kind, ObjectOperation.object_id)
                           .where(ObjectOperation.status.in_(vt.BUSY)))
    return [(str(k), str(i)) for k, i in rows]


def op_state(session: Session, kind: str, object_id: str) -> OpState | None:
    op = session.get(ObjectOperation, (kind, object_id))
    if op is None or op.status not in vt.BUSY:
        return None
    right = session.get(UseRight, (kind, object_id))
    return OpState(kind, object_id, op.op, op.status, op.pool_id, op.target_pool_id,
                   op.target_capacity_bytes, op.node_id, op.epoch,
                   right.holder_node_id if right is not None else None,
                   right.last_holder_node_id if right is not None else None)


def grant_for_op(session: Session, kind: str, object_id: str, node_id: str,
                 now: datetime) -> int | None:
    """Give the node the use right for the operation; remember node and epoch."""
    op = session.get(ObjectOperation, (kind, object_id), with_for_update=True)
    right = session.get(UseRight, (kind, object_id), with_for_update=True)
    if op is None or right is None or op.status not in vt.BUSY:
        return None
    epoch = use_rights.grant(right, node_id, now)
    op.node_id, op.epoch, op.updated_at = node_id, epoch, now
    return epoch


def op_failed(session: Session, kind: str, object_id: str, message: str,
              now: datetime) -> None:
    op = session.get(ObjectOperation, (kind, object_id), with_for_update=True)
    if op is None or op.status != vt.RUNNING:
        return
    op.status, op.error, op.updated_at = vt.OP_FAILED, message, now
    record_event(session, now, object_id, f"{op.op}.failed", {"kind": kind,
                                                              "error": message})


def _owner(session: Session, kind: str, object_id: str,
           ) -> tuple[Volume | None, Workspace | None]:
    if kind == VOLUME:
        return session.get(Volume, object_id, with_for_update=True), None
    ws = session.scalars(select(Workspace).where(Workspace.layer_ref == object_id)
                         .with_for_update()).first()
    return None, ws


def expand_done(session: Session, kind: str, object_id: str, capacity_bytes: int,
                now: datetime) -> None:
    op = session.get(ObjectOperation, (kind, object_id), with_for_update=True)
    if op is None or op.op != EXPAND or op.status != vt.RUNNING:
        return
    vol, ws = _owner(session, kind, object_id)
    if vol is not None:
        vol.capacity_bytes = capacity_bytes
        vol.revision += 1
        vol.updated_at = now
    if ws is not None:
        ws.layer_size_bytes = capacity_bytes
        ws.updated_at = now
    session.delete(op)
    record_event(session, now, object_id, "expand.done",
                 {"kind": kind, "capacity_bytes": capacity_bytes})


def move_switch(session: Session, kind: str, object_id: str, shared: bool,
                now: datetime) -> None:
    """The copy is in the target pool: the object (record and use right) is there
    now; the old copy is deleted next (status ``cleanup``)."""
    op = session.get(ObjectOperation, (kind, object_id), with_for_update=True)
    right = session.get(UseRight, (kind, object_id), with_for_update=True)
    if op is None or op.op != MOVE or op.status != vt.RUNNING or right is None:
        return
    assert op.target_pool_id is not None
    vol, ws = _owner(session, kind, object_id)
    if vol is not None:
        vol.pool_id = op.target_pool_id
        vol.revision += 1
        vol.updated_at = now
    if ws is not None:
        ws.layer_pool_id = op.target_pool_id
        ws.updated_at = now
    right.pool_id = op.target_pool_id
    right.pool_shared = shared
    right.updated_at = now
    op.status, op.updated_at = vt.CLEANUP, now
    record_event(session, now, object_id, "move.copied",
                 {"kind": kind, "from": op.pool_id, "to": op.target_pool_id})


def move_done(session: Session, kind: str, object_id: str, now: datetime) -> None:
    """The old copy is gone: the move is over.  In a shared pool nobody holds the
    object now, as after a normal stop."""
    op = session.get(ObjectOperation, (kind, object_id), with_for_update=True)
    if op is None or op.op != MOVE or op.status != vt.CLEANUP:
        return
    right = session.get(UseRight, (kind, object_id), with_for_update=True)
    if right is not None:
        use_rights.release_after_stop(right, now)
    session.delete(op)
    record_event(session, now, object_id, "move.done",
                 {"kind": kind, "from": op.pool_id, "to": op.target_pool_id})
