"""Node commands and node changes between ctrl replicas on PostgreSQL (docs/replicas.md).

A replica's services command a node through its `SessionHub`; when the node's session
lives on another replica, the hub hands the command to `CommandRelay.call`, which
queues it in the store for the holder (`kibotos.ctrl.store.relay_queue`) and waits for
the outcome the holder stores.  Each replica's `CommandRelay.run` takes what is queued
for it, sends it over its own session and stores the outcome.

Promptness comes from ``LISTEN``/``NOTIFY`` on one dedicated connection per replica
(the queue's two channels, and `NODE_CHANNEL`, on which every committed change of a node
row is announced, so the other replicas' placement indexes see a node that connected
elsewhere at once rather than at their next resync); correctness does not depend on
them: the loop also looks at the queue every `POLL_INTERVAL`, and a lost notification
costs that much time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import trio
from sqlalchemy.orm import Session

from kibotos.core import ids
from kibotos.core.errors import DeadlineExceeded, KibotosError, Unavailable, error_from_wire
from kibotos.ctrl.live.node_sessions import SessionHub
from kibotos.ctrl.model import nodes
from kibotos.ctrl.model import workspace_txns as tx
from kibotos.ctrl.store import allocation_notes
from kibotos.ctrl.store import relay_queue as q
from kibotos.ctrl.store.changes import Change, NodeSnapshot
from kibotos.ctrl.store.db import Store
from kibotos.ctrl.store.models import Node
from kibotos.protocol import Args, CloseReason, CreateSpec, DestroyArgs

if TYPE_CHECKING:  # psycopg is the optional PostgreSQL extra: imported where used
    import psycopg

log = logging.getLogger("kibotos.ctrl.relay")

#: How often the queue and the sessions of other replicas are read without a
#: notification.
POLL_INTERVAL = 1.0
#: What a relayed command may take beyond the command's own timeout: the two hops
#: through the store.
RELAY_MARGIN = 5.0
#: Not a node command: the relayed request to close the node's session (``args``:
#: ``reason``, a `CloseReason`), which the holder does itself.
CLOSE_KIND = "session.close"
#: How long a relayed close may take.
CLOSE_TIMEOUT = 10.0
#: How often a relayed create's record is looked for in the store when no
#: notification said it was recorded (or given up: its destroy relayed here).
RECORD_POLL_INTERVAL = 1.0
#: Committed changes of node rows (payload ``<replica_id> <node_id>``).
NODE_CHANNEL = "kibotos_nodes"


def _announce_nodes(replica_id: str) -> Callable[[Session, Any], None]:
    """An ``after_flush`` hook: NOTIFY every node row the flush wrote (PostgreSQL
    delivers it at commit, and not at all on rollback)."""
    def hook(session: Session, _context: Any) -> None:
        written = {obj.node_id for obj in (*session.new, *session.dirty)
                   if isinstance(obj, Node)}
        for node_id in written:
            q.notify(session, NODE_CHANNEL, f"{replica_id} {node_id}")
    return hook


class CommandRelay:
    """This replica's end of the relay (the module docstring)."""

    def __init__(self, store: Store, hub: SessionHub, replica_id: str,
                 publish: Callable[[list[Change]], None],
                 inflight: dict[str, trio.Event]) -> None:
        self.store = store
        self.hub = hub
        self.replica_id = replica_id
        self._publish = publish
        self._inflight = inflight
        self._conninfo = store.engine.url.set(drivername="postgresql").render_as_string(
            hide_password=False)
        self._done: dict[str, trio.Event] = {}
        self._work = trio.Event()
        self._changed_nodes: set[str] = set()
        self._nodes_changed = trio.Event()
        #: Nodes whose live session another live replica holds, as last read.
        self.elsewhere: set[str] = set()
        #: Relayed creates sent here whose record (or destroy) is awaited, by Instance.
        self._awaited: dict[str, trio.Event] = {}
        store.listen("after_flush", _announce_nodes(replica_id))
        store.listen("before_commit", allocation_notes.announcer(replica_id))

    # ------------------------------------------------------------------ sender

    def alive_elsewhere(self) -> AbstractSet[str]:
        return self.elsewhere

    async def call(self, node_id: str, args: Args, timeout: float) -> dict[str, object]:
        """Have the replica holding the node's session send the command; its result,
        or the node's error as if the command had been sent here."""
        return await self._relay(node_id, args.KIND, args.to_wire(), timeout)

    async def close(self, node_id: str, reason: CloseReason) -> None:
        """Have the replica holding the node's session close it (a revoke or retire
        through this replica); nothing to do when no live replica holds one."""
        try:
            await self._relay(node_id, CLOSE_KIND, {"reason": reason.value}, CLOSE_TIMEOUT)
        except Unavailable:
            return  # no live session anywhere: the node's next hello is refused
        except KibotosError as exc:  # what was decided is committed; the close is late
            log.warning("relay: closing the session of node %s failed: %s", node_id, exc)

    async def _relay(self, node_id: str, kind: str, args: dict[str, Any], timeout: float
                     ) -> dict[str, object]:
        holder = await self.store.run(partial(q.session_holder, node_id=node_id))
        if holder is None or holder == self.replica_id:
            raise Unavailable(f"node {node_id} has no live control session")
        relay_id = ids.new_id("rly")
        done = self._done[relay_id] = trio.Event()
        try:
            await self.store.write(partial(
                q.enqueue, relay_id=relay_id, node_id=node_id, replica_id=holder,
                kind=kind, args=args, timeout_s=timeout))
            deadline = trio.current_time() + timeout + RELAY_MARGIN
            while (row := await self.store.write(partial(q.outcome, relay_id=relay_id))
                   ) is None:
                if trio.current_time() >= deadline:
                    never_sent = await self.store.write(partial(q.abandon,
                                                                relay_id=relay_id))
                    if never_sent:
                        raise Unavailable(f"node {node_id}: replica {holder}, which holds "
                                          "its session, did not take the command")
                    raise DeadlineExceeded(f"node {node_id} did not answer {kind} "
                                           f"through replica {holder} within {timeout:g} s")
                with trio.move_on_at(min(deadline, trio.current_time() + POLL_INTERVAL)):
                    await done.wait()
        finally:
            self._done.pop(relay_id, None)
        if row.error is not None:
            raise error_from_wire({"error": row.error})
        return dict(row.result or {})

    # ------------------------------------------------------------------ holder

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._listen)
            nursery.start_soon(self._follow_nodes)
            task_status.started()
            while True:
                self._work = trio.Event()
                try:
                    for queued in await self.store.write(partial(
                            q.take, replica_id=self.replica_id)):
                        nursery.start_soon(self._send, queued)
                    self.elsewhere = await self.store.run(partial(
                        q.alive_elsewhere, replica_id=self.replica_id))
                except KibotosError as exc:
                    log.warning("relay: reading the queue failed: %s", exc)
                with trio.move_on_after(POLL_INTERVAL):
                    await self._work.wait()

    async def _send(self, queued: q.Queued) -> None:
        """Send one relayed command.  A create's Instance is not recorded until its
        sender commits, after this outcome: until then it is in flight here too, so the
        node's first frames of it wait (`NodeFeed`) instead of reading as an Instance
        nobody recorded, which would be destroyed."""
        instance_id = queued.args.get("instance_id")
        if queued.kind == DestroyArgs.KIND and isinstance(instance_id, str):
            # The sender gave the create up (its record went stale): stop waiting.
            awaited = self._awaited.get(instance_id)
            if awaited is not None:
                awaited.set()
        if queued.kind != CreateSpec.KIND or not isinstance(instance_id, str) or \
                instance_id in self._inflight:
            await self._send_and_store(queued)
            return
        recorded = self._inflight[instance_id] = trio.Event()
        awaited = self._awaited[instance_id] = trio.Event()
        try:
            if await self._send_and_store(queued):
                with trio.move_on_after(queued.timeout_s + RELAY_MARGIN):
                    while True:
                        with trio.move_on_after(RECORD_POLL_INTERVAL):
                            await awaited.wait()
                        if awaited.is_set() or await self._recorded(instance_id):
                            break
        finally:
            del self._inflight[instance_id]
            self._awaited.pop(instance_id, None)
            recorded.set()

    async def _recorded(self, instance_id: str) -> bool:
        """Whether the sender recorded the Instance; a store error reads as "not yet"
        (logged): this runs in the relay's nursery, where an exception would end the
        relay and ctrl with it, for a check the next poll makes again."""
        try:
            return await self.store.run(partial(tx.instance_known, instance_id=instance_id))
        except KibotosError as exc:
            log.warning("relay: looking for the record of Instance %s failed, trying "
                        "again: %s", instance_id, exc)
            return False

    async def _send_and_store(self, queued: q.Queued) -> bool:
        """Send, store the outcome; whether the node accepted."""
        result: dict[str, Any] | None = None
        error: dict[str, Any] | None = None
        session = self.hub.get(queued.node_id)
        if session is None:
            error = Unavailable(f"node {queued.node_id} has no live control session on "
                                f"replica {self.replica_id}").to_wire()["error"]
        elif queued.kind == CLOSE_KIND:
            await session.close(CloseReason(queued.args["reason"]))
            result = {}
        else:
            try:
                result = await session.call_wire(queued.kind, queued.args, queued.timeout_s)
            except KibotosError as exc:
                error = exc.to_wire()["error"]
        try:
            await self.store.write(partial(q.finish, relay_id=queued.relay_id,
                                           result=result, error=error))
        except KibotosError as exc:  # the sender gives up at its deadline
            log.warning("relay: storing the outcome of %s failed: %s", queued.relay_id, exc)
        return error is None

    async def _follow_nodes(self) -> None:
        """Read the node rows other replicas changed and hand them to the indexes; push
        overcommit ratios another replica changed to the nodes whose sessions are here."""
        while True:
            await self._nodes_changed.wait()
            self._nodes_changed = trio.Event()
            changed, self._changed_nodes = self._changed_nodes, set()
            try:
                snapshots = await self.store.run(partial(_node_snapshots, node_ids=changed))
            except KibotosError as exc:
                log.warning("relay: reading changed nodes failed: %s", exc)
                continue
            if snapshots:
                self._publish(list(snapshots))
            for snap in snapshots:
                # New overcommit ratios set through another replica, for a node whose
                # session is here: push them now, not at the node's next welcome (until
                # the node confirms them, no replica places on it).
                if self.hub.get(snap.node_id) is not None and \
                        not nodes.overcommit_confirmed(cast(nodes.NodeFacts, snap)):
                    self.hub.push_overcommit(snap.node_id)

    # ------------------------------------------------------------------ listener

    def _connect(self) -> psycopg.Connection[Any]:
        import psycopg

        conn = psycopg.connect(self._conninfo, autocommit=True)
        for channel in (q.WORK_CHANNEL, q.DONE_CHANNEL, NODE_CHANNEL,
                        allocation_notes.CHANNEL):
            conn.execute(f"LISTEN {channel}")
        return conn

    @staticmethod
    def _wait(conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
        """What arrived by the first notification (with any that came in the same
        packet), or nothing after `POLL_INTERVAL`.  Without ``stop_after`` the wait
        would collect for the whole interval, delaying every notification by up to a
        second: each relayed command's hand-over and answer, every other replica's
        node and Allocation changes."""
        return [(n.channel, n.payload)
                for n in conn.notifies(timeout=POLL_INTERVAL, stop_after=1)]

    async def _listen(self) -> None:
        import psycopg

        while True:
            try:
                conn = await trio.to_thread.run_sync(self._connect)
                try:
                    while True:
                        for channel, payload in await trio.to_thread.run_sync(
                                self._wait, conn):
                            self._notified(channel, payload)
                finally:
                    conn.close()
            except psycopg.Error as exc:
                log.warning("relay: the notification connection failed: %s", exc)
                await trio.sleep(POLL_INTERVAL)

    def _notified(self, channel: str, payload: str) -> None:
        if channel == q.WORK_CHANNEL and payload == self.replica_id:
            self._work.set()
        elif channel == q.DONE_CHANNEL:
            waiter = self._done.get(payload)
            if waiter is not None:
                waiter.set()
        elif channel == allocation_notes.CHANNEL:
            self._allocations_noted(payload)
        elif channel == NODE_CHANNEL:
            replica_id, _, node_id = payload.partition(" ")
            if replica_id != self.replica_id and node_id:
                self._changed_nodes.add(node_id)
                self._nodes_changed.set()
                self._work.set()  # re-read who holds which session

    def _allocations_noted(self, payload: str) -> None:
        """Another replica's committed Allocations: into the index at once, and a
        relayed create waiting for its record is recorded."""
        changes: list[Change] = []
        for replica_id, snap in allocation_notes.decode(payload):
            awaited = self._awaited.get(snap.instance_id)
            if awaited is not None:
                awaited.set()
            if replica_id != self.replica_id:
                changes.append(snap)
        if changes:
            self._publish(changes)


def _node_snapshots(session: Session, node_ids: set[str]) -> list[NodeSnapshot]:
    return [NodeSnapshot.of(node) for node_id in sorted(node_ids)
            if (node := session.get(Node, node_id)) is not None]
