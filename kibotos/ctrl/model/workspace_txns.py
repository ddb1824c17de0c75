"""The store transactions of the Workspace operations, one function each.

`workspace_ops` talks to nodes and calls these through `Store.run`/`Store.write`; each
takes the rows it changes ``FOR UPDATE`` and checks again what the operation was
decided on, because a node call may have taken seconds in between.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import bindparam, func, insert, select
from sqlalchemy.orm import Session

from kibotos.core.errors import FailedPrecondition, NotFound
from kibotos.ctrl.model import instances as inst_mod
from kibotos.ctrl.model import network_policy as netpol
from kibotos.ctrl.model import nodes, overcommit
from kibotos.ctrl.model import workspace_records as w
from kibotos.ctrl.pools import capacity as pool_capacity
from kibotos.ctrl.pools import operator_writes as pool_ops
from kibotos.ctrl.pools import use_rights
from kibotos.ctrl.store import changes as store_changes
from kibotos.ctrl.store.models import (
    Allocation,
    ClusterSetting,
    Event,
    Instance,
    Node,
    Template,
    UseRight,
    Workspace,
    WorkspaceLabel,
)
from kibotos.protocol import NetworkPolicy


class Stale(Exception):
    """The store disagrees with what placement chose (another ctrl replica, or a change
    that committed meanwhile): give the Instance back and try another node."""


@dataclass(frozen=True)
class RightPlan:
    kind: str
    object_id: str
    pool_id: str
    shared: bool
    holder_node_id: str | None
    last_holder_node_id: str | None
    epoch: int
    bump_on_grant: bool

    def epoch_for(self, node_id: str) -> int:
        last = self.holder_node_id or self.last_holder_node_id
        if last == node_id and not self.bump_on_grant and self.epoch > 0:
            return self.epoch
        return self.epoch + 1


@dataclass(frozen=True)
class StartPlan:
    workspace_id: str
    revision: int
    template: dict[str, str]
    cpu_millis: int
    memory_bytes: int
    layer_size_bytes: int
    labels: dict[str, str]
    rights: tuple[RightPlan, ...]
    #: As stored (None: the deployment default), and its revision.
    network_policy: dict[str, Any] | None = None
    network_revision: int = 1


def template_of(session: Session, name: str) -> dict[str, str]:
    row = session.get(Template, name)
    if row is None:
        raise NotFound(f"template {name} does not exist", details={"template": name})
    return {"name": row.name, "image_digest": row.image_digest,
            "kernel_digest": row.kernel_digest, "initramfs_digest": row.initramfs_digest}


#: The chosen node's row, locked: other replicas' records of it wait for this one.
_NODE_FOR_UPDATE = (select(*Node.__table__.columns)
                    .where(Node.node_id == bindparam("node_id")).with_for_update())
#: What the node's unreleased Allocations hold, and the overcommit default, read in a
#: statement of its own *after* the lock: in READ COMMITTED a statement sees what was
#: committed when it started, so a sum in the locking statement could miss the
#: Allocation of the transaction it waited for.
_SETTING = ClusterSetting.__table__
_USED = select(
    func.coalesce(func.sum(Allocation.cpu_millis), 0),
    func.coalesce(func.sum(Allocation.memory_bytes), 0),
    select(_SETTING.c.value).where(_SETTING.c.key == overcommit.DEFAULT_KEY)
    .scalar_subquery(),
    select(_SETTING.c.version).where(_SETTING.c.key == overcommit.DEFAULT_KEY)
    .scalar_subquery(),
).where(Allocation.node_id == bindparam("node_id"), Allocation.released_at.is_(None))


def verify_node(session: Session, node_id: str, cpu: int, mem: int) -> None:
    """The store's own verdict on the chosen node, in the transaction that records the
    Allocation: with several ctrl replicas the in-memory index of one does not see the
    placements of another until they commit.  Two plain statements (no ORM load): the
    locked row, then the sum."""
    node = session.execute(_NODE_FOR_UPDATE, {"node_id": node_id}).first()
    if node is None:
        raise Stale(f"node {node_id} is gone")
    facts = cast(nodes.NodeFacts, node)
    ok, reason = nodes.placeable(facts)
    if not ok:
        raise Stale(f"node {node_id} is no longer placeable: {reason}")
    used_cpu, used_mem, value, version = session.execute(_USED, {"node_id": node_id}).one()
    sched_cpu, sched_mem = overcommit.schedulable(facts, overcommit.default_of(value, version))
    if used_cpu + cpu > sched_cpu or used_mem + mem > sched_mem:
        raise Stale(f"node {node_id} has no longer room for it")


def commit_create(session: Session, *, workspace_id: str, template: Mapping[str, str],
                  labels: dict[str, str], cpu_millis: int, memory_bytes: int,
                  layer_size_bytes: int, layer_ref: str, pool_id: str, pool_shared: bool,
                  node_id: str, instance_id: str, now: datetime,
                  verify: bool = True, default_capacity: int | None = None,
                  network: netpol.Resolved | None = None,
                  sent: NetworkPolicy | None = None) -> dict[str, Any]:
    """Record an accepted create; `network` is the Workspace's policy as resolved
    before placement and `sent` what its node was sent (None: no network)."""
    if verify:
        verify_node(session, node_id, cpu_millis, memory_bytes)
    pool_capacity.check_room(session, pool_id, layer_size_bytes, "writable layer", now,
                             default_capacity)
    network = network or netpol.Resolved(None)
    netpol.check_unchanged(session, network)
    ws = w.new_workspace(workspace_id=workspace_id, template=template, labels=labels,
                         cpu_millis=cpu_millis, memory_bytes=memory_bytes,
                         layer_size_bytes=layer_size_bytes, layer_pool_id=pool_id,
                         layer_ref=layer_ref, now=now, network_policy=network.policy)
    w.set_executing(ws, instance_id, node_id)
    instance = inst_mod.new_instance(instance_id=instance_id, ws=ws, node_id=node_id, now=now)
    netpol.store_on_instance(instance, sent, ws.network_revision)
    right = use_rights.new_right(kind=use_rights.RETAINED_LAYER, object_id=layer_ref,
                                 workspace_id=workspace_id, pool_id=pool_id,
                                 shared=pool_shared, now=now)
    use_rights.grant(right, node_id, now)
    # All new rows: plain INSERTs skip the ORM's unit of work (a third of a create's
    # CPU on ctrl); `store_changes.note` still hands the Workspace and the Allocation to
    # the in-memory index after the commit.
    objects: list[Any] = [
        ws, instance,
        inst_mod.new_allocation(instance_id=instance_id, ws=ws, node_id=node_id, now=now),
        right,
        *(WorkspaceLabel(workspace_id=workspace_id, key=k, value=v) for k, v in labels.items()),
    ]
    for obj in objects:
        table = obj.__table__
        session.execute(insert(table), [{c.key: getattr(obj, c.key) for c in table.columns}])
        store_changes.note(session, obj)
    session.execute(insert(Event), [{
        "at": now, "subject": workspace_id, "kind": "transition", "text": None,
        "detail": {"from": None, "to": ws.state, "cause": f"create on node {node_id}"}}])
    return w.workspace_json(ws)


def _startable(session: Session, ws: Workspace) -> None:
    if ws.state in (w.CREATING, w.STARTING, w.AVAILABLE):
        raise FailedPrecondition(
            f"workspace {ws.workspace_id} is {ws.state} on node {ws.node_id}: stop it "
            "first (or use `kibo workspace move`)",
            details={"workspace_id": ws.workspace_id, "state": ws.state})
    if ws.state in (w.STOPPING, w.DELETING, w.DELETED):
        raise FailedPrecondition(f"workspace {ws.workspace_id} is {ws.state}",
                                 details={"workspace_id": ws.workspace_id, "state": ws.state})
    if inst_mod.holds_allocation(session, ws.current_instance_id):
        raise FailedPrecondition(
            f"workspace {ws.workspace_id} is FAILED ({ws.reason}) and its Instance "
            f"{ws.current_instance_id} still holds its resources on node {ws.node_id}: "
            f"stop it with `kibo workspace stop {ws.workspace_id} --force` first",
            details={"workspace_id": ws.workspace_id, "state": ws.state,
                     "instance_id": ws.current_instance_id})


def _plan_rights(rights: list[UseRight]) -> tuple[RightPlan, ...]:
    return tuple(RightPlan(r.object_kind, r.object_id, r.pool_id, r.pool_shared,
                           r.holder_node_id, r.last_holder_node_id, r.epoch,
                           r.bump_on_grant) for r in rights)


def start_plan(session: Session, workspace_id: str, expected: int | None) -> StartPlan:
    ws = w.get_workspace(session, workspace_id)
    w.check_revision(ws, expected)
    _startable(session, ws)
    rights = list(use_rights.rights_of(session, workspace_id))
    pool_ops.refuse_lost(session, workspace_id, {r.pool_id for r in rights})
    return StartPlan(ws.workspace_id, ws.revision,
                     {"name": ws.template_name, "image_digest": ws.image_digest,
                      "kernel_digest": ws.kernel_digest,
                      "initramfs_digest": ws.initramfs_digest},
                     ws.cpu_millis, ws.memory_bytes, ws.layer_size_bytes, dict(ws.labels),
                     _plan_rights(rights), ws.network_policy, ws.network_revision)


def commit_start(session: Session, *, plan: StartPlan, expected: int | None, node_id: str,
                 instance_id: str, now: datetime, verify: bool = True,
                 network: netpol.Resolved | None = None,
                 sent: NetworkPolicy | None = None) -> dict[str, Any]:
    """Record an accepted start; `network` and `sent` as for `commit_create`."""
    ws = w.get_workspace(session, plan.workspace_id, for_update=True)
    w.check_revision(ws, expected)
    _startable(session, ws)
    rights = list(use_rights.rights_of(session, plan.workspace_id, for_update=True))
    if ws.revision != plan.revision or _plan_rights(rights) != plan.rights:
        raise Stale(f"workspace {plan.workspace_id} changed while it was being placed")
    if verify:
        verify_node(session, node_id, ws.cpu_millis, ws.memory_bytes)
    netpol.check_unchanged(session, network or netpol.Resolved(None))
    for right in rights:
        use_rights.grant(right, node_id, now)
    w.set_executing(ws, instance_id, node_id)
    w.transition(session, ws, w.STARTING, f"start on node {node_id}", now)
    instance = inst_mod.new_instance(instance_id=instance_id, ws=ws, node_id=node_id, now=now)
    netpol.store_on_instance(instance, sent, ws.network_revision)
    session.add_all([
        instance,
        inst_mod.new_allocation(instance_id=instance_id, ws=ws, node_id=node_id, now=now),
    ])
    return w.workspace_json(ws)


def begin_stop(session: Session, workspace_id: str, force: bool, expected: int | None,
               now: datetime) -> dict[str, Any]:
    """AVAILABLE (or booting) → STOPPING; a FAILED one whose Instance still holds its
    resources needs ``force``; nothing executing → STOPPED at once."""
    ws = w.get_workspace(session, workspace_id, for_update=True)
    w.check_revision(ws, expected)
    how = "stop --force" if force else "stop"
    executing = inst_mod.holds_allocation(session, ws.current_instance_id)
    if ws.state in (w.DELETING, w.DELETED):
        raise FailedPrecondition(f"workspace {workspace_id} is {ws.state}",
                                 details={"workspace_id": workspace_id, "state": ws.state})
    if ws.state == w.STOPPING:
        if force and not ws.stop_force:
            ws.stop_force = True
            ws.revision += 1
            nodes.record_event(session, now, workspace_id, "stop_force", None)
    elif ws.state == w.FAILED and executing and not force:
        raise FailedPrecondition(
            f"workspace {workspace_id} is FAILED ({ws.reason}); its Instance "
            f"{ws.current_instance_id} still holds its resources on node {ws.node_id}: "
            "use --force (the node destroys the Instance after a short guest sync)",
            details={"workspace_id": workspace_id, "state": ws.state})
    elif ws.state in (w.AVAILABLE, w.CREATING, w.STARTING) or (
            ws.state == w.FAILED and executing):
        ws.stop_force = force
        w.transition(session, ws, w.STOPPING, how, now)
    elif ws.state == w.FAILED:
        w.clear_executing(ws)
        w.transition(session, ws, w.STOPPED, f"{how} (nothing was running)", now)
    return w.workspace_json(ws)


def continue_stop(session: Session, workspace_id: str, instance_id: str | None, force: bool,
                  now: datetime) -> dict[str, Any] | None:
    """The same stop command again after the node refused it (spec troubleshooting: stop
    only the unit you confirmed, then "retry the original command with the same
    --command-id"): while the Instance that stop was for is still the Workspace's,
    FAILED and holding its resources, the stop begins again (the command's revision
    check was done the first time).  Otherwise None: the stored answer stands."""
    ws = session.get(Workspace, workspace_id, with_for_update=True)
    if (ws is None or ws.state != w.FAILED or instance_id is None
            or ws.current_instance_id != instance_id
            or not inst_mod.holds_allocation(session, instance_id)):
        return None
    return begin_stop(session, workspace_id, force, None, now)


def stop_done(session: Session, workspace_id: str, instance_id: str, confirmed: bool,
              node_id: str, now: datetime) -> None:
    ws = session.get(Workspace, workspace_id, with_for_update=True)
    inst = session.get(Instance, instance_id, with_for_update=True)
    if ws is None or inst is None or ws.state != w.STOPPING:
        return
    # The STOPPING that ctrl began for an OOM kill carries the reason to STOPPED.
    oom = ws.reason == w.OOM_REASON
    cause = f"node {node_id} confirmed the stop" + (" (force)" if ws.stop_force else "")
    inst_mod.finish_stop(session, ws, inst, confirmed=confirmed, cause=cause, now=now,
                         reason=w.OOM_REASON if oom else None)


def stop_failed(session: Session, workspace_id: str, instance_id: str, message: str,
                now: datetime) -> None:
    ws = session.get(Workspace, workspace_id, with_for_update=True)
    if ws is None or ws.state != w.STOPPING or ws.current_instance_id != instance_id:
        return
    w.transition(session, ws, w.FAILED, "the node could not stop the Instance", now,
                 reason=message)


def stop_nothing(session: Session, workspace_id: str, now: datetime) -> None:
    ws = session.get(Workspace, workspace_id, with_for_update=True)
    if ws is None or ws.state != w.STOPPING:
        return
    w.clear_executing(ws)
    w.transition(session, ws, w.STOPPED, "stop (nothing was running)", now)


def begin_delete(session: Session, workspace_id: str, expected: int | None,
                 now: datetime) -> dict[str, Any]:
    ws = w.get_workspace(session, workspace_id, for_update=True)
    w.check_revision(ws, expected)
    if ws.state in (w.DELETING, w.DELETED):
        return w.workspace_json(ws)
    if ws.state not in (w.STOPPED, w.FAILED):
        raise FailedPrecondition(
            f"workspace {workspace_id} is {ws.state}: stop it first",
            details={"workspace_id": workspace_id, "state": ws.state})
    w.transition(session, ws, w.DELETING, "delete", now)
    return w.workspace_json(ws)


@dataclass(frozen=True)
class DeleteState:
    state: str
    instance_id: str | None
    node_id: str | None
    executing: bool
    rights: tuple[RightPlan, ...]


def delete_state(session: Session, workspace_id: str) -> DeleteState | None:
    ws = session.get(Workspace, workspace_id)
    if ws is None:
        return None
    return DeleteState(ws.state, ws.current_instance_id, ws.node_id,
                       inst_mod.holds_allocation(session, ws.current_instance_id),
                       _plan_rights(list(use_rights.rights_of(session, workspace_id))))


def instance_destroyed(session: Session, workspace_id: str, instance_id: str,
                       now: datetime) -> None:
    inst = session.get(Instance, instance_id, with_for_update=True)
    ws = session.get(Workspace, workspace_id, with_for_update=True)
    if inst is None:
        return
    if inst.state != inst_mod.I_DESTROYED:
        inst_mod.note_state(inst, inst_mod.I_DESTROYED, inst.reason, now)
    inst_mod.gone(session, ws, inst, now, "destroyed for delete")


def instance_discarded(session: Session, instance_id: str, now: datetime) -> None:
    inst = session.get(Instance, instance_id, with_for_update=True)
    if inst is not None:
        instance_destroyed(session, inst.workspace_id, instance_id, now)


def grant_for_delete(session: Session, kind: str, object_id: str, node_id: str,
                     now: datetime) -> int | None:
    right = session.get(UseRight, (kind, object_id), with_for_update=True)
    if right is None:
        return None
    return use_rights.grant(right, node_id, now)


def object_deleted(session: Session, kind: str, object_id: str) -> None:
    right = session.get(UseRight, (kind, object_id), with_for_update=True)
    if right is not None:
        session.delete(right)


def finish_delete(session: Session, workspace_id: str, now: datetime) -> bool:
    ws = session.get(Workspace, workspace_id, with_for_update=True)
    if ws is None or ws.state != w.DELETING:
        return False
    if use_rights.rights_of(session, workspace_id):
        return False
    w.clear_executing(ws)
    ws.deleted_at = now
    w.transition(session, ws, w.DELETED, "delete finished", now)
    return True


def pending_operations(session: Session) -> list[tuple[str, str]]:
    """(workspace_id, state) of every Workspace a background operation must finish."""
    rows = session.execute(select(Workspace.workspace_id, Workspace.state)
                           .where(Workspace.state.in_((w.STOPPING, w.DELETING))))
    return [(str(i), str(s)) for i, s in rows]


def stop_state(session: Session, workspace_id: str
               ) -> tuple[str, str | None, str | None, bool, bool] | None:
    """(state, current Instance, node, executing, force) of a Workspace."""
    ws = session.get(Workspace, workspace_id)
    if ws is None:
        return None
    return (ws.state, ws.current_instance_id, ws.node_id,
            inst_mod.holds_allocation(session, ws.current_instance_id), ws.stop_force)


def instance_known(session: Session, instance_id: str) -> bool:
    return session.get(Instance, instance_id) is not None
