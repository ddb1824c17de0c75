"""Whether each declared pool can be used, as facts for ctrl, refreshed continually.

A pool is available when its marker names the pool the configuration declares and then
its driver plugin (``[[storage.pool]] driver``, default ``local``) accepts the mount.
The marker comes first: a driver may change host settings for the mount (the NFS
driver's writeback limit), which it must not do for a directory that is not the pool.
Both are re-checked every `REFRESH` seconds, so a later ``storage-pool init`` or a
repaired mount makes the pool available without a node restart (spec: within a minute).

When a dedicated pool becomes available for the first time in this process, its
temporary files are removed then (spec: a pool unavailable at start is cleaned when it
becomes available); `on_first_available` is the hook for that and for old names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from kibotos.backends import Availability, HostPaths, PoolSpec, StorageDriver
from kibotos.config import PoolSection
from kibotos.core.errors import KibotosError
from kibotos.core.logs import EventLogger
from kibotos.node.storage.pools.marker import MarkerProblem, check_marker

log = EventLogger()
#: Seconds between two checks of every pool (the spec asks for at least once a minute).
REFRESH = 30.0


@dataclass(frozen=True)
class PoolState:
    """One pool's availability as reported to ctrl."""

    pool_id: str
    available: bool
    reason: str | None
    instance: str | None  # the marker's ``instance``; None without a valid marker
    warnings: tuple[str, ...] = ()

    def to_wire(self, pool: PoolSection) -> dict[str, Any]:
        return {"id": pool.id, "shared": pool.shared, "default": pool.default,
                "driver": pool.driver, "available": self.available, "reason": self.reason,
                "instance": self.instance, "warnings": list(self.warnings)}


def pool_spec(pool: PoolSection) -> PoolSpec:
    return PoolSpec(id=pool.id, path=pool.path, default=pool.default, shared=pool.shared,
                    driver=pool.driver)


def check_pool(pool: PoolSection, driver: StorageDriver | None, host: HostPaths,
               driver_error: str | None = None) -> PoolState:
    """The marker, then the driver.  Never raises: every failure is a reason."""
    try:
        marker = check_marker(pool.id, pool.path)
    except MarkerProblem as exc:
        return PoolState(pool.id, False, exc.reason, None)
    if driver is None:
        return PoolState(pool.id, False, driver_error or f"storage driver {pool.driver!r} "
                         "is not available", marker.instance)
    try:
        result: Availability = driver.check(pool_spec(pool), host)
    except KibotosError as exc:
        result = Availability(False, exc.message)
    except OSError as exc:
        result = Availability(False, f"pool {pool.id}: {exc.strerror or exc}")
    warnings = tuple(result.warnings)
    return PoolState(pool.id, result.available, None if result.available else result.reason,
                     marker.instance, warnings)


def build_drivers(pools: Sequence[PoolSection], registry: Any
                  ) -> dict[str, tuple[StorageDriver | None, str | None]]:
    """One driver object per pool (drivers may keep per-mount state); an unknown
    driver name makes that pool unavailable with the registry's message rather than
    stopping the node, so the other pools keep working."""
    out: dict[str, tuple[StorageDriver | None, str | None]] = {}
    for pool in pools:
        try:
            out[pool.id] = (registry.get(pool.driver)({}), None)
        except KibotosError as exc:
            out[pool.id] = (None, exc.message)
    return out


@dataclass
class PoolMonitor:
    """Keeps every pool's `PoolState`; `refresh` checks them all once, `run` forever."""

    pools: Sequence[PoolSection]
    registry: Any  # kibotos.plugins.Registry of storage drivers
    host: HostPaths = field(default_factory=HostPaths)
    on_change: Callable[[], None] | None = None
    on_first_available: Callable[[PoolSection], None] | None = None
    states: dict[str, PoolState] = field(default_factory=dict)
    _drivers: dict[str, tuple[StorageDriver | None, str | None]] = field(default_factory=dict)
    _seen_available: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._drivers = build_drivers(self.pools, self.registry)

    def refresh(self) -> bool:
        """Check every pool once (blocking: call from a thread); True if any changed."""
        changed = False
        for pool in self.pools:
            driver, error = self._drivers[pool.id]
            state = check_pool(pool, driver, self.host, error)
            old = self.states.get(pool.id)
            self.states[pool.id] = state
            if old != state:
                changed = True
                log_fn = log.info if state.available else log.warning
                log_fn("storage pool availability changed", pool=pool.id,
                       available=state.available, reason=state.reason,
                       instance=state.instance)
                for warning in state.warnings:
                    if old is None or warning not in old.warnings:
                        log.warning("storage pool warning", pool=pool.id, warning=warning)
            if state.available and pool.id not in self._seen_available:
                self._seen_available.add(pool.id)
                if self.on_first_available is not None:
                    self.on_first_available(pool)
        return changed

    def facts(self) -> list[dict[str, Any]]:
        """``facts.pools`` of hello and report: every declared pool, in config order."""
        out = []
        for pool in self.pools:
            state = self.states.get(pool.id) or PoolState(pool.id, False,
                                                         "not checked yet", None)
            out.append(state.to_wire(pool))
        return out

    def available(self, pool_id: str) -> bool:
        state = self.states.get(pool_id)
        return state is not None and state.available

    def unavailable_reason(self, pool_id: str) -> str | None:
        """None when the pool can be used now, else why not (for the objects code)."""
        state = self.states.get(pool_id)
        if state is None:
            return "not checked yet"
        return None if state.available else (state.reason or "unavailable")

    async def run(self, *, interval: float = REFRESH,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Refresh now, report started, then every `interval` seconds."""
        await self._refresh_async()
        task_status.started()
        while True:
            await trio.sleep(interval)
            await self._refresh_async()

    async def _refresh_async(self) -> None:
        # A hard NFS mount can block in the kernel; a thread keeps the node's session
        # alive meanwhile (abandon_on_cancel: a stuck stat must not block shutdown).
        changed = await trio.to_thread.run_sync(self.refresh, abandon_on_cancel=True)
        if changed and self.on_change is not None:
            self.on_change()
