"""The store's committed changes, delivered in the trio thread: the feed of ctrl's
in-memory indexes (`kibotos.ctrl.model.placement.CapacityIndex`, the Template cache).

Rather than asking each writer to remember to notify the indexes, `StoreWatch` listens
to the store's own session events: after a flush it snapshots the `Node`,
`Allocation`, `ClusterSetting`, `Workspace` and `Template` rows the flush wrote
(`kibotos.ctrl.store.changes`), and after the outermost commit it hands the snapshots
over; a rollback drops them.  So a change reaches the index if and only if it
committed.

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
from typing import Any

import trio
from sqlalchemy.orm import Session

from kibotos.ctrl.store.changes import INFO_KEY, Change, Subscriber, snapshot
from kibotos.ctrl.store.db import Store

log = logging.getLogger("kibotos.ctrl.live.store_watch")


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

    def publish(self, batch: list[Change]) -> None:
        """Hand changes committed elsewhere (another ctrl replica's, read back from the
        store: `kibotos.ctrl.relay`) to the subscribers, after what is pending here."""
        self.drain()
        self._deliver(batch)

    def drain(self) -> None:
        """Hand every committed snapshot to the subscribers (trio thread only)."""
        if not self._pending:
            return
        batch: list[Change] = []
        while self._pending:
            batch.append(self._pending.popleft())
        self._deliver(batch)

    def _deliver(self, batch: list[Change]) -> None:
        for fn in self._subscribers:
            try:
                fn(batch)
            except Exception:  # one broken subscriber must not starve the others
                log.exception("store watch subscriber %r failed", fn)

    # ------------------------------------------------------------ session events

    def _after_flush(self, session: Session, _flush_context: Any) -> None:
        changes: dict[tuple[str, str], Change] = session.info.setdefault(INFO_KEY, {})
        for obj in (*session.new, *session.dirty, *session.deleted):
            snap = snapshot(obj)
            if snap is not None:
                changes[snap[0]] = snap[1]

    def _after_commit(self, session: Session) -> None:
        changes = session.info.pop(INFO_KEY, None)
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
        session.info.pop(INFO_KEY, None)

