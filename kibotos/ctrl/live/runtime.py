"""What ctrl's live services share, built once per ctrl (`kibotos.ctrl.serve.build_services`).

The Workspace service, its background tasks, the node feed, the placement loop, the
Volume service, the object operations and the Transfer service all work on the same
few things: the context (config, store, sessions, clock, metrics), the command journal,
the in-memory `CapacityIndex` and the `StoreWatch` that feeds it, the creates and
starts whose node accepted but whose records are not committed yet (``inflight``), and
one nursery for background work with one sweep that resumes it.  `Runtime` holds them
and each collaborator takes it (or a callback of a sibling), so no service reaches into
another's attributes and none imports another that imports it back.

`Runtime.run` is the services' lifetime: it attaches the watch, loads the index,
resumes pending work (`sweep`, every `SWEEP_INTERVAL` and at start) and reloads the
index every `RESYNC_INTERVAL` for the placements of other ctrl replicas.  A round that
fails is logged and the loop goes on (a store error must not end ctrl).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from kibotos.core.errors import KibotosError, Unavailable
from kibotos.ctrl.live.context import CtrlContext
from kibotos.ctrl.live.store_watch import StoreWatch
from kibotos.ctrl.model.placement import CapacityIndex
from kibotos.ctrl.store.changes import Change, NodeSnapshot
from kibotos.ctrl.store.journal import Journal

# The name this logging had before the services were split (operators filter on it).
log = logging.getLogger("kibotos.ctrl.model.workspace_records")

#: How often pending operations are looked at again, and the index resynchronised.
SWEEP_INTERVAL = 5.0
RESYNC_INTERVAL = 60.0

Sweeper = Callable[[], Awaitable[None]]


class Runtime:
    """The shared state of the module docstring; its attributes are the services'
    common ground, read and changed only through what is public here."""

    def __init__(self, ctx: CtrlContext, index: CapacityIndex) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.journal = Journal(ctx.store, ctx.now)
        self.index = index
        self.watch = StoreWatch(ctx.store)
        self.watch.subscribe(self._on_changes)
        #: Creates and starts whose node accepted but whose records are not committed.
        self.inflight: dict[str, trio.Event] = {}
        self.running = False
        self._nursery: trio.Nursery | None = None
        #: The services' resumptions (Workspace stops and deletes, Volumes, object
        #: operations), in the order they were added; run by every `sweep`.
        self._sweepers: list[Sweeper] = []
        #: Whether this ctrl may resume pending work now: with several replicas on
        #: PostgreSQL only the lease holder does (`kibotos.ctrl.replica`), so two
        #: replicas never resume the same operation; a lone ctrl always may.
        self.holds_lease: Callable[[], bool] = lambda: True
        #: Whether other ctrl replicas place creates on this store (PostgreSQL): a
        #: create in flight there is not in `inflight`, so an Instance a node reports
        #: before its record may still be recorded (`NodeFeed`).
        self.foreign_creates = False
        self._node_changed = trio.Event()
        self._loading: list[list[Change]] | None = None

    @property
    def default_capacity(self) -> int | None:
        """The capacity a pool without one gets at its first create (``[testing]
        pool_capacity``: tests and the dev cluster)."""
        return self.ctx.config.testing.pool_capacity

    # ------------------------------------------------------------------ lifetime

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Load the index, resume pending operations, serve until cancelled."""
        self.watch.attach()
        await self.resync()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.running = True
            try:
                task_status.started()
                last_resync = trio.current_time()
                while True:
                    await self._round(self.sweep, "sweep")
                    await trio.sleep(SWEEP_INTERVAL)
                    if trio.current_time() - last_resync >= RESYNC_INTERVAL and \
                            await self._round(self.resync, "index resync"):
                        last_resync = trio.current_time()
            finally:
                self.running = False
                self._nursery = None
                self.watch.detach()

    async def _round(self, fn: Callable[[], Awaitable[None]], what: str) -> bool:
        """One sweep or resync of `run`; whether it succeeded.  A failed round (the
        store unreachable a moment, this replica's transaction aborted after a stall,
        its lease fenced out) is logged and the next round tries again: ending `run`
        would end ctrl, for an error the next round usually does not meet."""
        try:
            await fn()
        except KibotosError as exc:
            log.warning("ctrl: the %s failed, trying again next round: %s", what,
                        exc.message)
            return False
        except Exception:
            log.exception("ctrl: the %s failed, trying again next round", what)
            return False
        return True

    def require_running(self) -> None:
        if not self.running:
            raise Unavailable("ctrl's Workspace service is not running yet")

    async def resync(self) -> None:
        """Read the index afresh (ctrl start; and periodically, for the placements of
        other ctrl replicas).  Changes committed while reading are applied again after
        it, so none is lost to the older snapshot."""
        self._loading = []
        try:
            state = await self.store.run(CapacityIndex.read)
            self.watch.drain()
            self.index.install(state)
            for batch in self._loading:
                self.index.apply(batch)
        finally:
            self._loading = None

    def _on_changes(self, batch: list[Change]) -> None:
        if self._loading is not None:
            self._loading.append(batch)
        self.index.apply(batch)
        if any(isinstance(change, NodeSnapshot) for change in batch):
            self._node_changed.set()
            self._node_changed = trio.Event()

    async def wait_node_change(self, timeout: float) -> None:
        """Until a committed change of any node, or `timeout`: how tasks waiting for a
        node to come back pause between attempts."""
        with trio.move_on_after(timeout):
            await self._node_changed.wait()

    # ------------------------------------------------------------------ background

    def spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run `fn` in the background; without running services the sweep picks the
        work up once they run (what it finishes is recorded in the store)."""
        if self._nursery is not None:
            self._nursery.start_soon(self._guard, fn, *args)

    async def _guard(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await fn(*args)
        except KibotosError as exc:
            log.warning("%s%r failed: %s", fn.__name__, args, exc.message)
        except Exception:
            log.exception("%s%r failed", fn.__name__, args)

    def add_sweeper(self, sweeper: Sweeper) -> None:
        """Have every sweep call `sweeper` (after those added before it)."""
        self._sweepers.append(sweeper)

    async def sweep(self) -> None:
        """Resume every pending operation that has no task (each sweeper's part); only
        on the lease holder."""
        if not self.holds_lease():
            return
        for sweeper in self._sweepers:
            await sweeper()

    def wake(self) -> None:
        """A session started or ended: let waiting tasks look again now."""
        self.spawn(self.sweep)
