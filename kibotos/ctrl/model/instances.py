"""Instances and Allocations in ctrl, and what a node's reports about them do.

An Instance is one start of a Workspace on one node; its Allocation holds the CPU and
memory placement subtracts on that node until it is released.  The node reports each
Instance's state (``instance_state`` frames, and the full list in ``hello``/``report``);
this module turns those reports into the Workspace rows of docs/architecture.md:

* RUNNING while the Workspace is CREATING/STARTING → AVAILABLE;
* FAILED ``oom_killed`` → ctrl stops the Workspace on its own (STOPPING, then STOPPED
  with reason OOM_KILLED once the node confirms; the caller runs the stop);
* FAILED otherwise → the Workspace is FAILED with the node's reason; the Instance
  keeps its Allocation and use rights, so ``start`` is refused until ``stop --force``;
* STOPPED → the stop is finished (Allocation released, use rights per pool);
* DESTROYED, or missing from the node's full list → nothing of it remains on the node.

It also keeps each Instance's cleanup items (RUNTIME, VOLUME_ATTACHMENT, RESIDUAL) for
``cleanup-status``, and releases a node's Allocations and Workspaces on isolate.
Everything runs inside one store transaction; calls to nodes are `workspace_ops`'.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.core.errors import KibotosError
from kibotos.ctrl.model import workspace_records as w
from kibotos.ctrl.model.nodes import IsolateCounts
from kibotos.ctrl.pools import handoffs, use_rights
from kibotos.ctrl.store.models import Allocation, Instance, Workspace
from kibotos.ctrl.wire.base import as_utc, iso, parse_time
from kibotos.protocol import InstanceStatus

# The node's Instance states, by their short names here (plain strings, as the store
# keeps them); their one definition is `kibotos.protocol.InstanceStatus`.
I_CREATING = InstanceStatus.CREATING.value
I_RUNNING = InstanceStatus.RUNNING.value
I_STOPPING = InstanceStatus.STOPPING.value
I_STOPPED = InstanceStatus.STOPPED.value
I_FAILED = InstanceStatus.FAILED.value
I_DESTROYED = InstanceStatus.DESTROYED.value
INSTANCE_STATES = tuple(s.value for s in InstanceStatus)
#: The node's reason for a VMM the kernel's OOM killer ended.
NODE_OOM_REASON = "oom_killed"

# Cleanup items, their statuses and sources (``cleanup-status``).
IN_USE = "IN_USE"
PENDING = "PENDING"
RELEASED = "RELEASED"
UNKNOWN = "UNKNOWN"
NODE = "node"
CONTROL_PLANE = "control_plane"


@dataclass(frozen=True)
class Followup:
    """Work a report leaves for ctrl to do with the node after the commit: ``stop`` a
    Workspace (OOM), ``destroy`` an Instance ctrl does not know, ``discard`` one it
    knows but no longer wants."""

    action: str
    node_id: str
    instance_id: str
    workspace_id: str | None = None


def new_instance(*, instance_id: str, ws: Workspace, node_id: str,
                 now: datetime) -> Instance:
    return Instance(
        instance_id=instance_id, workspace_id=ws.workspace_id, node_id=node_id,
        state=I_CREATING, reason=None, cpu_millis=ws.cpu_millis,
        memory_bytes=ws.memory_bytes, guest=None, confirmed_on_disk=None,
        runtime_status=IN_USE, attachment_status=IN_USE, residual_status=IN_USE,
        cleanup_source=CONTROL_PLANE, cleanup_at=now, created_at=now, updated_at=now,
        ended_at=None)


def new_allocation(*, instance_id: str, ws: Workspace, node_id: str,
                   now: datetime) -> Allocation:
    return Allocation(instance_id=instance_id, node_id=node_id,
                      workspace_id=ws.workspace_id, cpu_millis=ws.cpu_millis,
                      memory_bytes=ws.memory_bytes, created_at=now, released_at=None)


def release_allocation(session: Session, instance_id: str, now: datetime) -> bool:
    alloc = session.get(Allocation, instance_id, with_for_update=True)
    if alloc is None or alloc.released_at is not None:
        return False
    alloc.released_at = now
    return True


def holds_allocation(session: Session, instance_id: str | None) -> bool:
    if instance_id is None:
        return False
    alloc = session.get(Allocation, instance_id)
    return alloc is not None and alloc.released_at is None


def _items(inst: Instance, runtime: str, attachment: str, residual: str, source: str,
           now: datetime) -> None:
    inst.runtime_status, inst.attachment_status, inst.residual_status = (
        runtime, attachment, residual)
    inst.cleanup_source = source
    inst.cleanup_at = now


def note_state(inst: Instance, state: str, reason: str | None, now: datetime,
               guest: dict[str, Any] | None = None, *, record_kept: bool = True,
               cleanup: dict[str, Any] | None = None) -> None:
    """Record the node's view of the Instance and what it says about cleanup.

    An Instance that ended on its node (STOPPED, DESTROYED) leaves a record there
    (`record_kept`) until ctrl stored the cleanup result and had it deleted
    (`kibotos.ctrl.live.registry_sweep`): RESIDUAL is PENDING until then.  A STOPPING
    Instance whose release is stuck (`cleanup{pending_since, held}`) shows RUNTIME
    PENDING, and VOLUME_ATTACHMENT PENDING while objects are held."""
    inst.state = state
    inst.reason = reason
    inst.updated_at = now
    if guest is not None:
        inst.guest = guest
    if state in (I_STOPPED, I_DESTROYED):
        residual = PENDING if record_kept else RELEASED
        _items(inst, RELEASED, RELEASED, residual, NODE, now)
        inst.ended_at = inst.ended_at or now
        inst.cleanup_pending_since, inst.cleanup_held = None, None
    elif state == I_STOPPING and cleanup is not None:
        held = [h for h in cleanup.get("held") or [] if isinstance(h, dict)]
        attached = any(h.get("item") == "VOLUME_ATTACHMENT" for h in held)
        _items(inst, PENDING, PENDING if attached else RELEASED, IN_USE, NODE, now)
        try:
            since = parse_time(cleanup.get("pending_since"), "cleanup.pending_since")
        except KibotosError:
            since = None
        inst.cleanup_pending_since = since or now
        inst.cleanup_held = held
    else:
        _items(inst, IN_USE, IN_USE, IN_USE, NODE, now)


def finish_stop(session: Session, ws: Workspace, inst: Instance, *, confirmed: bool | None,
                cause: str, now: datetime, reason: str | None = None) -> None:
    """The node confirmed the Instance stopped: release its Allocation, its use rights
    as the pool says, and make the Workspace STOPPED (unless it is being deleted)."""
    release_allocation(session, inst.instance_id, now)
    for right in use_rights.rights_of(session, ws.workspace_id, for_update=True):
        if right.holder_node_id == inst.node_id:
            use_rights.release_after_stop(right, now)
    if inst.state not in (I_STOPPED, I_DESTROYED):
        note_state(inst, I_STOPPED, inst.reason, now)
    if confirmed is not None:
        inst.confirmed_on_disk = confirmed
    if ws.current_instance_id == inst.instance_id:
        w.clear_executing(ws)
        if ws.state not in (w.DELETING, w.DELETED, w.STOPPED):
            w.transition(session, ws, w.STOPPED, cause, now, reason=reason)


def gone(session: Session, ws: Workspace | None, inst: Instance, now: datetime,
          cause: str) -> None:
    """Nothing of the Instance remains on its node (destroyed, or no longer listed)."""
    release_allocation(session, inst.instance_id, now)
    if ws is None or ws.current_instance_id != inst.instance_id:
        return  # an old Instance: the use rights are the current one's business
    for right in use_rights.rights_of(session, ws.workspace_id, for_update=True):
        if right.holder_node_id == inst.node_id:
            use_rights.release_after_stop(right, now)
    w.clear_executing(ws)
    if ws.state in (w.CREATING, w.STARTING, w.AVAILABLE, w.STOPPING):
        w.transition(session, ws, w.FAILED, cause, now, reason=w.EXITED_REASON)


def on_instance_state(session: Session, node_id: str, instance_id: str, state: str,
                      reason: str | None, now: datetime,
                      guest: dict[str, Any] | None = None,
                      cleanup: dict[str, Any] | None = None,
                      objects: list[Any] | None = None,
                      addresses: list[str] | None = None) -> list[Followup]:
    """Apply one report of the node about one Instance (see the module docstring);
    `objects` are the handoffs of what it opened (`handoffs`), `addresses` its guest's
    (kept until the node says otherwise)."""
    inst = session.get(Instance, instance_id, with_for_update=True)
    if inst is None or inst.node_id != node_id:
        # Not ours (a create ctrl gave up on, or a ctrl that lost its store): it must
        # not keep resources on the node.
        return [] if state == I_DESTROYED else [Followup("destroy", node_id, instance_id)]
    if objects:
        handoffs.note_objects(session, node_id=node_id, instance_id=instance_id,
                              workspace_id=inst.workspace_id, objects=objects, now=now)
    if addresses is not None and inst.state != I_DESTROYED:
        inst.addresses = list(addresses)
    if inst.state == I_DESTROYED or (inst.state == state and inst.reason == reason
                                     and guest is None and cleanup is None):
        return []
    note_state(inst, state, reason, now, guest, cleanup=cleanup)
    ws = session.get(Workspace, inst.workspace_id, with_for_update=True)
    current = ws is not None and ws.current_instance_id == instance_id
    cause = f"node {node_id}: Instance {instance_id} {state}"
    if ws is None:
        return []
    if state == I_RUNNING:
        if current and ws.state in (w.CREATING, w.STARTING):
            w.transition(session, ws, w.AVAILABLE, cause, now)
    elif state == I_FAILED:
        if not current:
            return []
        if reason == NODE_OOM_REASON:
            if ws.state in (w.CREATING, w.STARTING, w.AVAILABLE):
                ws.stop_force = False
                w.transition(session, ws, w.STOPPING, f"{cause} (OOM-killed): ctrl stops it",
                             now, reason=w.OOM_REASON)
                return [Followup("stop", node_id, instance_id, ws.workspace_id)]
        elif ws.state in (w.CREATING, w.STARTING, w.AVAILABLE):
            w.transition(session, ws, w.FAILED, cause, now, reason=reason or w.EXITED_REASON)
    elif state == I_STOPPED:
        if current and ws.state in (w.AVAILABLE, w.CREATING, w.STARTING):
            finish_stop(session, ws, inst, confirmed=None, cause=cause, now=now)
    elif state == I_DESTROYED:
        gone(session, ws, inst, now, cause)
    return []


def reconcile(session: Session, node_id: str, listed: Iterable[dict[str, Any]],
              now: datetime, listed_after: datetime,
              set_aside: Iterable[str] = ()) -> list[Followup]:
    """A node's full list of Instances (``hello``/``report``): apply each state, destroy
    those ctrl does not know, and treat ctrl's live Instances the node no longer lists
    as gone.

    Only Instances recorded before `listed_after` can be missing: the node sends frames,
    reports and command results from separate tasks, so a report made just before it
    accepted a create may arrive after ctrl recorded that create.  A ``hello`` is
    complete as of the session's start; a ``report`` is trusted for Instances older than
    a grace period.  An Instance being stopped or destroyed is left to that command.
    `set_aside`: Instances the node did list, whose entries the caller applies later
    (a create in flight): not missing."""
    followups: list[Followup] = []
    seen: set[str] = set(set_aside)
    for item in listed:
        instance_id, state = item.get("instance_id"), item.get("state")
        if not isinstance(instance_id, str) or state not in INSTANCE_STATES:
            continue
        seen.add(instance_id)
        reason, objects = item.get("reason"), item.get("objects")
        followups += on_instance_state(session, node_id, instance_id, str(state),
                                       reason if isinstance(reason, str) else None, now,
                                       objects=objects if isinstance(objects, list) else None)
        if state in (I_CREATING, I_RUNNING, I_STOPPING, I_FAILED):
            inst = session.get(Instance, instance_id)
            ws = session.get(Workspace, inst.workspace_id) if inst is not None else None
            if inst is not None and (ws is None or ws.current_instance_id != instance_id):
                # Still running there, but no longer wanted: what a node that was
                # isolated (and came back with a new incarnation) kept, or what survived
                # a lost answer.  Its Allocation is gone; it must go too.
                followups.append(Followup("discard", node_id, instance_id))
    live = session.scalars(select(Instance).where(
        Instance.node_id == node_id,
        Instance.state.in_((I_CREATING, I_RUNNING, I_STOPPING, I_FAILED))))
    for inst in live:
        if inst.instance_id in seen or inst.state == I_STOPPING or \
                as_utc(inst.created_at) >= listed_after:
            continue
        ws = session.get(Workspace, inst.workspace_id, with_for_update=True)
        if ws is not None and ws.state in (w.STOPPING, w.DELETING):
            continue
        note_state(inst, I_DESTROYED, "no longer listed by its node", now,
                   record_kept=False)
        gone(session, ws, inst, now, f"node {node_id} no longer lists Instance "
                                      f"{inst.instance_id}")
    return followups


def release_for_isolate(session: Session, node_id: str, now: datetime) -> IsolateCounts:
    """The isolate releaser (`CtrlContext.isolate_releasers`): use rights and
    Allocations on the node released at once, every Workspace executing there FAILED
    with reason UNAVAILABLE (a DELETING one goes on being deleted elsewhere)."""
    volumes, layers = use_rights.release_for_isolate(session, node_id, now)
    for alloc in session.scalars(select(Allocation).where(
            Allocation.node_id == node_id, Allocation.released_at.is_(None))):
        alloc.released_at = now
    failed = 0
    cause = f"isolate of node {node_id}"
    for ws in session.scalars(select(Workspace).where(Workspace.node_id == node_id)
                              .with_for_update()):
        inst = session.get(Instance, ws.current_instance_id) if ws.current_instance_id \
            else None
        if inst is not None and inst.state not in (I_STOPPED, I_DESTROYED):
            # What the host still runs is unknown until it returns (then it destroys
            # everything); the objects' use rights are released by ctrl now.
            _items(inst, UNKNOWN, RELEASED, UNKNOWN, CONTROL_PLANE, now)
        w.clear_executing(ws)
        if ws.state not in (w.DELETING, w.DELETED, w.STOPPED):
            if ws.state != w.FAILED:  # one FAILED already did not fail as a result
                failed += 1
            w.transition(session, ws, w.FAILED, cause, now, reason=w.UNAVAILABLE_REASON)
    return IsolateCounts(volumes, layers, failed)


def cleanup_items(inst: Instance, node_retired_at: datetime | None) -> list[dict[str, Any]]:
    """``cleanup-status`` of an Instance.  After its node was retired, everything is
    RELEASED as far as the control plane is concerned, and says so."""
    if node_retired_at is not None:
        return [{"item": item, "status": RELEASED, "source": CONTROL_PLANE,
                 "observed_at": iso(node_retired_at)}
                for item in ("RUNTIME", "VOLUME_ATTACHMENT", "RESIDUAL")]
    at = iso(inst.cleanup_at)
    return [
        {"item": "RUNTIME", "status": inst.runtime_status, "source": inst.cleanup_source,
         "observed_at": at},
        {"item": "VOLUME_ATTACHMENT", "status": inst.attachment_status,
         "source": inst.cleanup_source, "observed_at": at},
        {"item": "RESIDUAL", "status": inst.residual_status, "source": inst.cleanup_source,
         "observed_at": at},
    ]


def cleanup_pending(inst: Instance, node_retired_at: datetime | None) -> dict[str, Any]:
    """A release stuck on the node: since when, and which parts it still holds
    (``{item, part}``); ``pending_since`` null and ``held`` empty otherwise."""
    if node_retired_at is not None or inst.cleanup_pending_since is None:
        return {"pending_since": None, "held": []}
    return {"pending_since": iso(inst.cleanup_pending_since),
            "held": [h for h in inst.cleanup_held or [] if isinstance(h, dict)]}
