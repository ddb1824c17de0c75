"""What nodes say about their Instances, applied to the store in order: the
``instance_state`` frames and the Instance lists of ``hello`` and ``report``
(`instances.on_instance_state`, `instances.reconcile`), for `WorkspaceService`.  What
those rules ask for next (stop, destroy, discard) goes to the ``follow`` callback (the
Workspace tasks' `follow`).

A frame of a create still in flight (the node may send CREATING before the create's
result) is set aside and applied once the create is recorded: waiting for it in the
session's reader would block the very reader that must deliver that result.  A frame
that repeats the state last applied to its Instance is skipped.  A ``hello``'s list is
authoritative for Instances recorded before the session started; a ``report``'s list
is checked at most once per grace period per node, as a safety net behind the frames.
An entry of a hello's list for a create in flight is set aside like a frame and applied
after the create: the create's record would otherwise race it, and a node whose frames
went to a session that ended says its Instance's state again only in that list.

With several ctrl replicas a create may be in flight on another replica (it placed the
Instance through this replica's session, or through a replica that died and whose
node reconnected here): the node then reports an Instance this replica has no record
of yet.  Destroying it at once would leave the create's record, committed a moment
later, pointing at nothing (a Workspace CREATING for ever).  Such a frame, or such an
entry of a list, is set aside until the Instance is recorded or the longest such
create can have taken (`FOREIGN_CREATE_WINDOW`), and only then applied (or the Instance
destroyed).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from functools import partial

import trio

from kibotos.ctrl.live.placement_loop import CREATE_TIMEOUT
from kibotos.ctrl.live.runtime import Runtime
from kibotos.ctrl.model import instances as inst_mod
from kibotos.ctrl.model import workspace_txns as tx
from kibotos.protocol import Hello, InstanceState, InstanceSummary, Report

# The name ctrl's Workspace logging has always had (operators filter on it).
log = logging.getLogger("kibotos.ctrl.model.workspace_records")

#: A report may predate a create that ctrl recorded since (see `instances.reconcile`).
REPORT_GRACE_S = 30.0
APPLIED_CACHE = 100_000
#: How long an Instance a node reports may stay unrecorded while a create on another
#: replica records it: the sender's wait for the relayed answer (the create timeout
#: and the relay's margin of 5 s) and its commit, with room to spare.
FOREIGN_CREATE_WINDOW = CREATE_TIMEOUT + 15.0
#: How often a set-aside Instance's record is looked for.
RECORD_POLL_INTERVAL = 0.2


class NodeFeed:
    def __init__(self, runtime: Runtime, *,
                 follow: Callable[[Iterable[inst_mod.Followup]], None]) -> None:
        self.runtime = runtime
        self.follow = follow
        self._deferred: dict[str, list[tuple[str, InstanceState]]] = {}
        self._deferring: set[str] = set()
        #: The last state applied per Instance, to skip frames that repeat it.
        self._applied: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self._report_reconciled: dict[str, float] = {}

    async def session_started(self, node_id: str, hello: Hello) -> None:
        started = self.runtime.ctx.now()
        if hello.report.instances is not None:
            await self._reconcile(node_id, hello.report.instances, started, hello=True)
        self.runtime.wake()

    async def node_report(self, node_id: str, report: Report) -> None:
        if report.instances is None:
            return
        last = self._report_reconciled.get(node_id)
        if last is not None and trio.current_time() - last < REPORT_GRACE_S:
            return
        self._report_reconciled[node_id] = trio.current_time()
        await self._reconcile(node_id, report.instances,
                              self.runtime.ctx.now() - timedelta(seconds=REPORT_GRACE_S))

    async def instance_state(self, node_id: str, frame: InstanceState) -> None:
        """Apply a frame, in order per Instance (see the module docstring)."""
        if not self._defer(node_id, frame):
            await self._apply_frame(node_id, frame)

    def _defer(self, node_id: str, frame: InstanceState) -> bool:
        """Set `frame` aside behind the create in flight for its Instance (or behind
        the frames set aside before it); whether it was."""
        key = frame.instance_id
        if key not in self.runtime.inflight and key not in self._deferred:
            return False
        self._deferred.setdefault(key, []).append((node_id, frame))
        if key not in self._deferring:
            self._deferring.add(key)
            self.runtime.spawn(self._apply_deferred, key)
        return True

    async def _apply_deferred(self, key: str, foreign: bool = False) -> None:
        try:
            pending = self.runtime.inflight.get(key)
            if pending is not None:
                await pending.wait()
            if foreign:
                await self._until_recorded(key)
            while self._deferred.get(key):
                node_id, frame = self._deferred[key].pop(0)
                await self._apply_frame(node_id, frame, set_aside_unknown=False)
        finally:
            self._deferred.pop(key, None)
            self._deferring.discard(key)

    def _set_aside(self, node_id: str, frame: InstanceState) -> None:
        """Apply `frame` once its Instance is recorded (another replica's create in
        flight) or `FOREIGN_CREATE_WINDOW` passed (the module docstring)."""
        key = frame.instance_id
        self._deferred.setdefault(key, []).insert(0, (node_id, frame))
        if key not in self._deferring:
            log.info("node %s: Instance %s is not recorded yet; waiting up to %g s for a "
                     "create on another replica to record it", node_id, key,
                     FOREIGN_CREATE_WINDOW)
            self._deferring.add(key)
            self.runtime.spawn(self._apply_deferred, key, True)

    async def _until_recorded(self, instance_id: str) -> None:
        with trio.move_on_after(FOREIGN_CREATE_WINDOW):
            while not await self.runtime.store.run(partial(tx.instance_known,
                                                           instance_id=instance_id)):
                await trio.sleep(RECORD_POLL_INTERVAL)

    def _unknown(self, followups: list[inst_mod.Followup]) -> set[str]:
        """The Instances `followups` would destroy as unrecorded, when a create on
        another replica may still record them."""
        if not self.runtime.foreign_creates:
            return set()
        return {f.instance_id for f in followups if f.action == "destroy"}

    async def _apply_frame(self, node_id: str, frame: InstanceState,
                           set_aside_unknown: bool = True) -> None:
        seen = (frame.state.value, frame.reason)
        if frame.guest is None and frame.cleanup is None and frame.addresses is None and \
                self._applied.get(frame.instance_id) == seen:
            return  # the node said it already (e.g. CREATING of a create just recorded)
        # The store keeps what the node said as plain JSON.
        followups = await self.runtime.store.write(partial(
            inst_mod.on_instance_state, node_id=node_id, instance_id=frame.instance_id,
            state=frame.state.value, reason=frame.reason, now=self.runtime.ctx.now(),
            guest=frame.guest.to_wire() if frame.guest is not None else None,
            cleanup=frame.cleanup.to_wire() if frame.cleanup is not None else None,
            objects=[o.to_wire() for o in frame.objects] if frame.objects is not None
            else None, addresses=frame.addresses))
        if set_aside_unknown and frame.instance_id in self._unknown(followups):
            self._set_aside(node_id, frame)
            return
        self.remember(frame.instance_id, seen)
        self.follow(followups)

    def created(self, instance_id: str) -> None:
        """A create or start recorded its Instance CREATING (the placement loop says so):
        the node's CREATING frame that may follow repeats it and is skipped."""
        self.remember(instance_id, ("CREATING", None))

    def remember(self, instance_id: str, seen: tuple[str, str | None]) -> None:
        """Note the state last applied to an Instance."""
        self._applied[instance_id] = seen
        self._applied.move_to_end(instance_id)
        while len(self._applied) > APPLIED_CACHE:
            self._applied.popitem(last=False)

    async def _reconcile(self, node_id: str, listed: list[InstanceSummary],
                         listed_after: datetime, hello: bool = False) -> None:
        # A hello's entry of a create in flight is applied after the create, as its
        # frames are: reconciled now it would race the create's record (read as an
        # Instance nobody recorded), and dropped it would be lost, since a node that
        # said RUNNING on a session that ended (a replica stopped or gone) says it
        # again only here.  A report's is skipped: the next report has it again.
        # Either way the Instance was listed: if its create commits before this
        # write, it must not read as missing from the list.
        if hello:
            skip = {i.instance_id for i in listed if self._defer(node_id, _as_frame(i))}
        else:
            skip = {i.instance_id for i in listed if i.instance_id in self.runtime.inflight}
        followups = await self.runtime.store.write(partial(
            inst_mod.reconcile, node_id=node_id,
            listed=[i.to_wire() for i in listed if i.instance_id not in skip],
            now=self.runtime.ctx.now(), listed_after=listed_after, set_aside=skip))
        unknown = self._unknown(followups)
        for item in listed:
            if item.instance_id in unknown:
                self._set_aside(node_id, _as_frame(item))
        self.follow([f for f in followups if not (f.action == "destroy"
                                                 and f.instance_id in unknown)])


def _as_frame(item: InstanceSummary) -> InstanceState:
    """A list's entry as the frame that says the same of its Instance."""
    return InstanceState(instance_id=item.instance_id, workspace_id=item.workspace_id,
                         state=item.state, reason=item.reason, objects=item.objects)
