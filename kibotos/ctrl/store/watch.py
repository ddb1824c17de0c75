"""What committed to the store, as it commits: the feed of ctrl's in-memory indexes.

Placement keeps every node's admission facts and every unreleased Allocation in memory
(`kibotos.ctrl.model.placement.CapacityIndex`), because reading a thousand node rows per
placement would cost more than the placement itself.  For such a cache to stay true to
the store, it must learn of *every* committed change, whoever made it: a session's
report, an operator's drain, an isolate's releases.  Rather than asking each writer to
remember to notify it, this module listens to the store's own session events: after a
flush it snapshots the `Node`, `Allocation`, `ClusterSetting` and `Workspace` rows that
the flush wrote, and after the outermost commit it hands the snapshots over; a rollback drops
them.  So a change reaches the index if and only if it committed.

Snapshots are taken in the worker thread that ran the transaction and delivered in the
trio thread: queued on a thread-safe deque and drained by `TrioToken.run_sync_soon`
(which runs before the task that awaited the write resumes, because trio delivers the
worker's result through the same FIFO queue) and by every reader (`drain`).  Writes
through SQL statements that bypass the ORM (``update(Node)`` in bulk) are not seen;
the one such write, marking sessions dead at ctrl start, happens before the index
loads.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio
from sqlalchemy.orm import Session

from kibotos.ctrl.store.db import Store
from kibotos.ctrl.store.models import Allocation, ClusterSetting, Node, Template, Workspace

log = logging.getLogger("kibotos.ctrl.store.watch")

_INFO_KEY = "kibotos.store_watch"
NODE_COLUMNS = tuple(c.key for c in Node.__table__.columns)


class NodeSnapshot:
    """The column values of one `Node` row at commit; satisfies `nodes.NodeFacts`."""

    __slots__ = NODE_COLUMNS
    node_id: str
    drain_requested: bool
    session_alive: bool

    def __init__(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            setattr(self, name, value)

    @classmethod
    def of(cls, node: Any) -> NodeSnapshot:
        return cls({name: getattr(node, name) for name in NODE_COLUMNS})


@dataclass(frozen=True)
class AllocationSnapshot:
    instance_id: str
    node_id: str
    cpu_millis: int
    memory_bytes: int
    released: bool


@dataclass(frozen=True)
class WorkspaceSnapshot:
    workspace_id: str
    state: str
    revision: int


@dataclass(frozen=True)
class TemplateSnapshot:
    """A Template row written or deleted (readers drop what they cached of it)."""

    name: str


@dataclass(frozen=True)
class SettingSnapshot:
    key: str
    value: dict[str, Any]
    version: int


Change = (NodeSnapshot | AllocationSnapshot | SettingSnapshot | WorkspaceSnapshot
          | TemplateSnapshot)
Subscriber = Callable[[list[Change]], None]


def _snapshot(obj: object) -> tuple[tuple[str, str], Change] | None:
    if isinstance(obj, Node):
        return ("node", obj.node_id), NodeSnapshot.of(obj)
    if isinstance(obj, Allocation):
        return ("allocation", obj.instance_id), AllocationSnapshot(
            obj.instance_id, obj.node_id, int(obj.cpu_millis), int(obj.memory_bytes),
            obj.released_at is not None)
    if isinstance(obj, Template):
        return ("template", obj.name), TemplateSnapshot(obj.name)
    if isinstance(obj, Workspace):
        return ("workspace", obj.workspace_id), WorkspaceSnapshot(
            obj.workspace_id, obj.state, int(obj.revision))
    if isinstance(obj, ClusterSetting):
        return ("setting", obj.key), SettingSnapshot(obj.key, dict(obj.value),
                                                     int(obj.version))
    return None


def note(session: Session, obj: object) -> None:
    """Record `obj` as written in this transaction, for a write that bypasses the ORM's
    unit of work (a Core ``insert`` of rows built as model objects): it reaches the
    subscribers after the commit exactly as a flushed object would."""
    snap = _snapshot(obj)
    if snap is not None:
        session.info.setdefault(_INFO_KEY, {})[snap[0]] = snap[1]


class StoreWatch:
    """Committed snapshots of nodes, Allocations and settings, for in-memory indexes."""

    def __init__(self, store: Store) -> None:
        self._pending: deque[Change] = deque()
        self._subscribers: list[Subscriber] = []
        self._token: trio.lowlevel.TrioToken | None = None
        store.listen("after_flush", self._after_flush)
        store.listen("after_commit", self._after_commit)
        store.listen("after_rollback", self._after_rollback)

    def subscribe(self, fn: Subscriber) -> None:
        self._subscribers.append(fn)

    def attach(self) -> None:
        """Deliver from now on through the current trio run (call from trio)."""
        self._token = trio.lowlevel.current_trio_token()

    def detach(self) -> None:
        self._token = None
        self._pending.clear()

    def drain(self) -> None:
        """Hand every committed snapshot to the subscribers (trio thread only)."""
        if not self._pending:
            return
        batch: list[Change] = []
        while self._pending:
            batch.append(self._pending.popleft())
        for fn in self._subscribers:
            try:
                fn(batch)
            except Exception:  # one broken subscriber must not starve the others
                log.exception("store watch subscriber %r failed", fn)

    # ------------------------------------------------------------ session events

    def _after_flush(self, session: Session, _flush_context: Any) -> None:
        changes: dict[tuple[str, str], Change] = session.info.setdefault(_INFO_KEY, {})
        for obj in (*session.new, *session.dirty, *session.deleted):
            snap = _snapshot(obj)
            if snap is not None:
                changes[snap[0]] = snap[1]

    def _after_commit(self, session: Session) -> None:
        changes = session.info.pop(_INFO_KEY, None)
        token = self._token
        if not changes or token is None:
            # Not attached yet (or any more): whoever attaches reads the whole state
            # afterwards (`WorkspaceService.resync`), so nothing needs keeping.
            return
        self._pending.extend(changes.values())
        try:
            token.run_sync_soon(self.drain, idempotent=True)
        except trio.RunFinishedError:
            self._token = None

    def _after_rollback(self, session: Session) -> None:
        session.info.pop(_INFO_KEY, None)

