"""ctrl's collection of the nodes' records of ended Instances (spec:
node-and-vmm-processes, "Records of ended Instances").

Once every ``reconcile_interval`` (a minute by default) ctrl asks each live node for
its oldest records (``registry.list{limit: 100}``).  For each record whose Instance's
Allocation is released, whose Workspace has no command in progress and no longer uses
it as the current Instance, ctrl first stores the cleanup result the node observed
(statuses and ``observed_at``: the moment the node saw the cleanup finish) and only
then has the node delete those records (``registry.delete{instance_ids}``), so
``cleanup-status`` reads the same result afterwards.  A record of an Instance ctrl
never knew has nothing to store and is deleted too.

When the node listed all its records (``more`` false), an ended Instance of that node
whose record ctrl expected (RESIDUAL PENDING, ended before the list was asked for) but
did not get was deleted by hand before its result was stored: its runtime items become
UNKNOWN, decided by the control plane.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import datetime
from functools import partial
from typing import Any

import trio
from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.core.errors import KibotosError
from kibotos.ctrl.live.context import CtrlContext
from kibotos.ctrl.model import instances as inst_mod
from kibotos.ctrl.model import workspace_records as w
from kibotos.ctrl.store.models import Instance, Workspace
from kibotos.ctrl.wire.base import as_utc, parse_time
from kibotos.protocol import LIST_LIMIT, RegistryDeleteArgs, RegistryListArgs

log = logging.getLogger("kibotos.ctrl.live.registry_sweep")

#: At most this many records per node each time (spec; the command's own ceiling).
LIMIT = LIST_LIMIT
COMMAND_TIMEOUT = 30.0
#: Nodes swept at the same time.
CONCURRENCY = 16
#: Workspace states in which a command is in progress: its records wait.
BUSY = frozenset({w.CREATING, w.STARTING, w.STOPPING, w.DELETING})
STATUSES = frozenset({inst_mod.IN_USE, inst_mod.PENDING, inst_mod.RELEASED,
                      inst_mod.UNKNOWN})
ENDED = (inst_mod.I_STOPPED, inst_mod.I_DESTROYED)


def _status(value: object) -> str:
    return value if isinstance(value, str) and value in STATUSES else inst_mod.UNKNOWN


def _time(value: object, now: datetime) -> datetime:
    try:
        return parse_time(value, "cleanup.observed_at") or now
    except KibotosError:
        return now


def store_results(session: Session, *, node_id: str, entries: Iterable[dict[str, Any]],
                  complete: bool, asked_at: datetime, now: datetime) -> list[str]:
    """Store what the node observed for each record ctrl no longer needs; the IDs whose
    records the node may delete now (see the module docstring)."""
    deletable: list[str] = []
    listed: set[str] = set()
    for entry in entries:
        instance_id = entry.get("instance_id")
        if not isinstance(instance_id, str):
            continue
        listed.add(instance_id)
        inst = session.get(Instance, instance_id, with_for_update=True)
        if inst is None:
            deletable.append(instance_id)
            continue
        if inst.node_id != node_id or inst_mod.holds_allocation(session, instance_id):
            continue
        ws = session.get(Workspace, inst.workspace_id)
        if ws is not None and (ws.current_instance_id == instance_id or ws.state in BUSY):
            continue
        cleanup = entry.get("cleanup")
        cleanup = cleanup if isinstance(cleanup, dict) else {}
        observed = _time(cleanup.get("observed_at") or entry.get("ended_at"), now)
        if inst.state not in ENDED and entry.get("state") in ENDED:
            inst.state = str(entry["state"])
        inst.ended_at = inst.ended_at or observed
        inst.runtime_status = _status(cleanup.get("RUNTIME"))
        inst.attachment_status = _status(cleanup.get("VOLUME_ATTACHMENT"))
        inst.residual_status = _status(cleanup.get("RESIDUAL"))
        inst.cleanup_source = inst_mod.NODE
        inst.cleanup_at = observed
        inst.cleanup_pending_since, inst.cleanup_held = None, None
        inst.cleanup_stored_at = now
        deletable.append(instance_id)
    if complete:
        for inst in session.scalars(select(Instance).where(
                Instance.node_id == node_id, Instance.state.in_(ENDED),
                Instance.residual_status == inst_mod.PENDING,
                Instance.cleanup_stored_at.is_(None)).with_for_update()):
            if inst.instance_id in listed or inst.ended_at is None or \
                    as_utc(inst.ended_at) >= asked_at:
                continue
            log.warning("node %s: the record of ended Instance %s is gone before its "
                        "cleanup result was stored: runtime items unknown", node_id,
                        inst.instance_id)
            inst.runtime_status = inst.attachment_status = inst_mod.UNKNOWN
            inst.residual_status = inst_mod.RELEASED
            inst.cleanup_source = inst_mod.CONTROL_PLANE
            inst.cleanup_at = now
            inst.cleanup_stored_at = now
    return deletable


class RegistrySweep:
    """The background task; `sweep_node` is one node's round (tests call it)."""

    def __init__(self, ctx: CtrlContext, interval: float, *,
                 live_nodes: Callable[[], list[str]]) -> None:
        self.ctx = ctx
        self.interval = interval
        self.live_nodes = live_nodes

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        task_status.started()
        next_round = trio.current_time() + self.interval
        while True:
            await trio.sleep_until(next_round)
            next_round = max(next_round + self.interval, trio.current_time())
            await self.sweep_all()

    async def sweep_all(self) -> None:
        """One round over the live nodes, a few at a time (a large cluster must not
        flood the store with a thousand transactions at once)."""
        limiter = trio.CapacityLimiter(CONCURRENCY)
        async with trio.open_nursery() as nursery:
            for node_id in self.live_nodes():
                nursery.start_soon(self._sweep_logged, node_id, limiter)

    async def _sweep_logged(self, node_id: str, limiter: trio.CapacityLimiter) -> None:
        try:
            async with limiter:
                await self.sweep_node(node_id)
        except KibotosError as exc:
            log.info("node %s: ended-Instance records not collected now: %s", node_id,
                     exc.message)

    async def sweep_node(self, node_id: str) -> list[str]:
        """One round with one node; the records it deleted."""
        asked_at = self.ctx.now()
        listed = await self.ctx.sessions.call(node_id, RegistryListArgs(limit=LIMIT),
                                              COMMAND_TIMEOUT)
        entries = listed.get("entries")
        entries = [e for e in entries if isinstance(e, dict)] \
            if isinstance(entries, list) else []
        deletable = await self.ctx.store.write(partial(
            store_results, node_id=node_id, entries=entries,
            complete=listed.get("more") is False, asked_at=asked_at, now=self.ctx.now()))
        if not deletable:
            return []
        result = await self.ctx.sessions.call(
            node_id, RegistryDeleteArgs(instance_ids=deletable), COMMAND_TIMEOUT)
        deleted = result.get("deleted")
        return [str(i) for i in deleted] if isinstance(deleted, list) else []
