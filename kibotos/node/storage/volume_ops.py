"""The node's storage commands: ``volume.create``, ``volume.delete``, ``object.expand``,
``object.copy`` (docs/architecture.md, "Session commands"; spec: storage-pools-on-nfs).

`NodeStorage` does them for the Instance manager, which owns the Instances: an object a
live Instance holds (or is about to open) is refused (``failed_precondition``), and an
object one of these commands is working on is refused to the others and to
``instance.create`` (`check_idle`), so on this node nothing opens a block file that is
being made, grown or copied.  Across nodes the use right's epoch does that job: every
command takes the use right at its epoch with the spec's takeover table
(`kibotos.node.storage.objects`) and releases it cleanly when done (metadata
``released_cleanly``, then the receipt), so the next node opens it at that epoch or a
newer one without waiting.

* ``volume.create``: IDs were checked by the argument models before anything here; the
  block file is made by truncate + ``mkfs.ext4`` on the file (no preallocation), then the
  metadata records ``created_with``.  The same arguments again answer ``{created:
  true}`` (an interrupted create is finished); other arguments ``already_exists``.
* ``volume.delete``: ``{deleted: true}`` also when nothing was there; a newer epoch's
  holder refuses it.
* ``object.expand``: `kibotos.node.storage.expand` on the block file; the metadata's
  ``expansion`` records the target and the step (atomically, fenced by the holder),
  stays after a failure (the spec's "unfinished expansions") and goes on success, when
  ``capacity_bytes`` becomes the target.  A smaller target than the current capacity,
  or than an unfinished expansion's, is ``invalid_argument``: block files never shrink.
* ``object.copy``: `kibotos.node.storage.object_copy`.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

import trio

from kibotos.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KibotosError,
    NotFound,
)
from kibotos.core.logs import EventLogger
from kibotos.node.instances.lifecycle import Instance
from kibotos.node.storage import expand
from kibotos.node.storage.object_copy import copy_object
from kibotos.node.storage.object_records import release_or_fence, update_metadata
from kibotos.node.storage.objects import (
    RETAINED_LAYERS,
    VOLUMES,
    Holder,
    PoolObjects,
    UseRightTakenOver,
)
from kibotos.vmm_ready import first_kibotos_error

log = EventLogger()
T = TypeVar("T")

#: Command ``kind`` values → pool subdirectories.
KIND_DIRS = {"volume": VOLUMES, "retained_layer": RETAINED_LAYERS}
#: How often a running expansion rereads the holder record (the spec's 5 s check).
HOLDER_CHECK = 5.0
Key = tuple[str, str, str]  # (pool subdirectory, pool ID, object ID)


def _now() -> str:
    return datetime.now(UTC).isoformat()


def user_of(instances: Iterable[Instance], key: Key) -> Instance | None:
    """The live Instance that holds the object, or will open it (its create was
    accepted and its objects are not released)."""
    for inst in instances:
        if inst.released and not inst.holding:
            continue
        refs = set() if inst.released else {(h.kind, h.pool_id, h.object_id)
                                            for h in inst.held}
        if inst.holding:
            spec = inst.spec
            refs.add((RETAINED_LAYERS, spec.layer.pool_id, spec.layer.ref))
            refs.update((VOLUMES, v.pool_id, v.volume_id) for v in spec.volumes)
        if key in refs:
            return inst
    return None


class NodeStorage:
    """See the module docstring.  `pool` finds a configured pool's objects (raising
    ``failed_precondition`` for another pool), `instances` lists the manager's
    Instances, `retained` is the manager's set of objects this node keeps holding in
    its private pools (counted in ``volume_count``), `changed` asks for a report."""

    def __init__(self, *, node_id: str, pool: Callable[[str, str], PoolObjects],
                 instances: Callable[[], Iterable[Instance]],
                 shared_pools: Mapping[str, bool], retained: set[Key],
                 changed: Callable[[], None], tool_timeout: float = expand.TOOL_TIMEOUT,
                 total_timeout: float = expand.TOTAL_TIMEOUT,
                 tool_path: str = expand.TOOL_PATH,
                 holder_check: float = HOLDER_CHECK) -> None:
        self.node_id = node_id
        self.pool = pool
        self.instances = instances
        self.shared_pools = shared_pools
        self.retained = retained
        self.changed = changed
        self.tool_timeout = tool_timeout
        self.total_timeout = total_timeout
        self.tool_path = tool_path
        self.holder_check = holder_check
        self._busy: dict[Key, str] = {}

    # ------------------------------------------------------------------ guards

    def check_idle(self, key: Key) -> None:
        """Refuse while a storage command works on the object (``instance.create``
        asks too)."""
        doing = self._busy.get(key)
        if doing is not None:
            raise FailedPrecondition(f"{_label(key)} is being {doing} on node "
                                     f"{self.node_id}; retry when that is done",
                                     details={"reason": "object_busy"})

    def _check_unused(self, key: Key) -> None:
        inst = user_of(self.instances(), key)
        if inst is not None:
            raise FailedPrecondition(f"{_label(key)} is in use by Instance "
                                     f"{inst.instance_id} ({inst.state})",
                                     details={"reason": "in_use"})

    @contextlib.contextmanager
    def _working(self, doing: str, *keys: Key) -> Iterator[None]:
        for key in keys:
            self._check_unused(key)
            self.check_idle(key)
        for key in keys:
            self._busy[key] = doing
        try:
            yield
        finally:
            for key in keys:
                self._busy.pop(key, None)

    def _kept(self, key: Key, held: bool) -> None:
        """Objects of a private pool whose holder record names this node count as held
        (ctrl keeps that use right); in a shared pool they do not."""
        if held and not self.shared_pools.get(key[1], False):
            self.retained.add(key)
        else:
            self.retained.discard(key)
        self.changed()

    # ------------------------------------------------------------------ volumes

    async def volume_create(self, volume_id: str, pool_id: str, capacity: int, epoch: int
                            ) -> dict[str, Any]:
        pool = self.pool(pool_id, VOLUMES)
        key = (VOLUMES, pool_id, volume_id)
        run = trio.to_thread.run_sync
        with self._working("created", key):
            pool.check_available()
            if await run(self._created_already, pool, volume_id, capacity, epoch):
                return {"created": True}
            opened = await pool.open(volume_id, epoch, create_capacity=capacity)
            try:
                await run(functools.partial(update_metadata, pool, volume_id, epoch, {
                    "capacity_bytes": capacity,
                    "created_with": {"capacity_bytes": capacity, "epoch": epoch}}))
            finally:
                with trio.CancelScope(shield=True):
                    await self._release(pool, volume_id, epoch)
        self._kept(key, True)
        log.info("volume created", pool=pool_id, volume=volume_id, capacity_bytes=capacity,
                 epoch=epoch, new=opened.created)
        return {"created": True}

    @staticmethod
    def _created_already(pool: PoolObjects, volume_id: str, capacity: int, epoch: int
                         ) -> bool:
        """True when this create already happened; False when it is to be made or
        finished; `AlreadyExists` when the Volume exists with other arguments."""
        meta = pool.metadata(volume_id)
        if meta is None:
            return False
        wanted = {"capacity_bytes": capacity, "epoch": epoch}
        made = meta.get("created_with")
        if made is None:  # interrupted before created_with: same size, same epoch only
            if meta.get("capacity_bytes") == capacity and meta.get("state") in (
                    "created", "attached") and meta.get("epoch") in (None, epoch):
                return False
        elif made == wanted:
            unfinished = meta.get("state") != "released" and meta.get("epoch") == epoch \
                and meta.get("holder") == pool.node_id
            return not unfinished
        raise AlreadyExists(
            f"volume {volume_id} already exists in pool {pool.pool_id} with other arguments "
            f"(created with {made or {'capacity_bytes': meta.get('capacity_bytes')}}, this "
            f"command asks for {wanted})")

    async def volume_delete(self, volume_id: str, pool_id: str, epoch: int
                            ) -> dict[str, Any]:
        pool = self.pool(pool_id, VOLUMES)
        key = (VOLUMES, pool_id, volume_id)
        with self._working("deleted", key):
            existed = await trio.to_thread.run_sync(pool.delete, volume_id, epoch)
        self._kept(key, False)
        log.info("volume deleted", pool=pool_id, volume=volume_id, epoch=epoch,
                 existed=existed)
        return {"deleted": True}

    # ------------------------------------------------------------------ expand

    async def object_expand(self, kind: str, pool_id: str, object_id: str, epoch: int,
                            capacity: int) -> dict[str, Any]:
        sub = KIND_DIRS[kind]
        pool = self.pool(pool_id, sub)
        key = (sub, pool_id, object_id)
        run = trio.to_thread.run_sync
        with self._working("expanded", key):
            pool.check_available()
            await pool.settle_names(object_id, epoch)
            meta = await run(pool.metadata, object_id)
            path = pool.data_path(object_id)
            if meta is None or not await run(path.is_file):
                raise NotFound(f"{_label(key)} does not exist")
            size = (await run(os.stat, path)).st_size
            current = max(size, int(meta.get("capacity_bytes") or 0))
            pending = meta.get("expansion") or {}
            unfinished = pending.get("target_bytes")
            if isinstance(unfinished, int) and capacity < unfinished:
                raise InvalidArgument(
                    f"{_label(key)} has an unfinished expansion to {unfinished} bytes: "
                    f"expand again to a capacity no smaller than that, not {capacity}")
            if capacity < current:
                raise InvalidArgument(f"{_label(key)} has {current} bytes; it cannot shrink "
                                      f"to {capacity} (block files only grow)")
            if capacity == current == size and not pending:
                return {"capacity_bytes": capacity}
            await pool.open(object_id, epoch)
            try:
                geo = await self._watched(pool, object_id, epoch, functools.partial(
                    self._expand, pool, key, epoch, capacity, pending))
            finally:
                with trio.CancelScope(shield=True):
                    await self._release(pool, object_id, epoch)
        self._kept(key, True)
        log.info("storage object expanded", kind=kind, pool=pool_id, object=object_id,
                 capacity_bytes=capacity, epoch=epoch,
                 resize_inode="resize_inode" in geo.features)
        return {"capacity_bytes": capacity}

    async def _release(self, pool: PoolObjects, object_id: str, epoch: int) -> None:
        successor = await trio.to_thread.run_sync(release_or_fence, pool, object_id, epoch)
        if successor is not None:
            log.warning("storage object taken over during a command; receipt written",
                        pool=pool.pool_id, object=object_id, epoch=epoch,
                        successor=successor.node_id, successor_epoch=successor.epoch)

    async def _watched(self, pool: PoolObjects, object_id: str, epoch: int,
                       work: Callable[[], Awaitable[T]]) -> T:
        """Run `work` while rereading the holder record every `holder_check` seconds;
        a newer epoch cancels it (a running tool is killed) and raises
        `UseRightTakenOver`."""
        taken: list[Holder] = []
        result: list[T] = []

        async def watch(scope: trio.CancelScope) -> None:
            while True:
                await trio.sleep(self.holder_check)
                holder = await trio.to_thread.run_sync(pool.taken_over, object_id, epoch)
                if holder is not None:
                    taken.append(holder)
                    scope.cancel()
                    return

        async def run(scope: trio.CancelScope) -> None:
            try:
                result.append(await work())
            finally:
                scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, nursery.cancel_scope)
                nursery.start_soon(run, nursery.cancel_scope)
        except BaseExceptionGroup as group:
            found = first_kibotos_error(group) or _first_os_error(group)
            if found is None:
                raise
            raise found from None
        if taken:
            raise UseRightTakenOver(
                f"{pool.label} {object_id} in pool {pool.pool_id}: the use right was taken "
                f"over (node {taken[0].node_id} holds epoch {taken[0].epoch}) while this "
                f"node worked on it at epoch {epoch}; stopped, retrying will not succeed",
                details={"reason": "use_right_taken_over", "holder_epoch": taken[0].epoch})
        return result[0]

    async def _expand(self, pool: PoolObjects, key: Key, epoch: int, capacity: int,
                      pending: Mapping[str, Any]) -> expand.Geometry:
        object_id = key[2]
        state: dict[str, Any] = {
            "target_bytes": capacity, "started_at": pending.get("started_at") or _now(),
            "attempts": int(pending.get("attempts") or 0) + 1, "step": "start"}

        async def record(step: str, **extra: Any) -> None:
            state.update(step=step, updated_at=_now(), **extra)
            for name in [k for k, v in state.items() if v is None]:
                del state[name]
            await trio.to_thread.run_sync(update_metadata, pool, object_id, epoch,
                                          {"expansion": dict(state)})

        try:
            await record("start", last_error=None)
            geo = await expand.expand_file(pool.data_path(object_id), capacity,
                                           progress=record, tool_timeout=self.tool_timeout,
                                           total_timeout=self.total_timeout,
                                           tool_path=self.tool_path)
        except UseRightTakenOver:
            raise
        except (KibotosError, OSError) as exc:
            error = exc.message if isinstance(exc, KibotosError) else str(exc)
            log.error("storage object expansion failed", kind=key[0], pool=key[1],
                      object=object_id, target_bytes=capacity, step=state["step"],
                      error=error)
            with trio.CancelScope(shield=True), contextlib.suppress(KibotosError, OSError):
                await record(state["step"], last_error=error[-500:])
            if isinstance(exc, InvalidArgument):
                raise
            what = "the file system could not be checked" if state["step"] in (
                expand.CHECK, expand.RECHECK) else "the expansion did not complete"
            cls = type(exc) if isinstance(exc, KibotosError) else FailedPrecondition
            raise cls(f"{_label(key)}: {what} (step {state['step']}); expand again to "
                      f"{capacity} bytes or more to continue: {error[-300:]}",
                      details={"reason": "expansion_failed", "step": state["step"],
                               "target_bytes": capacity}) from None
        await trio.to_thread.run_sync(update_metadata, pool, object_id, epoch, {
            "capacity_bytes": capacity, "expansion": None, "expanded_at": _now(),
            "resize_inode": "resize_inode" in geo.features})
        return geo

    # ------------------------------------------------------------------ copy

    async def object_copy(self, kind: str, object_id: str, from_pool_id: str,
                          to_pool_id: str, epoch: int) -> dict[str, Any]:
        # Two distinct pools: `ObjectCopyArgs` refused the same one twice.
        sub = KIND_DIRS[kind]
        src, dst = self.pool(from_pool_id, sub), self.pool(to_pool_id, sub)
        keys = ((sub, from_pool_id, object_id), (sub, to_pool_id, object_id))
        with self._working("copied", *keys):
            src.check_available()
            dst.check_available()
            made = await self._watched(src, object_id, epoch, functools.partial(
                copy_object, src, dst, object_id, epoch))
        self._kept(keys[0], True)  # the source stays until ctrl deletes it
        self._kept(keys[1], True)
        log.info("storage object copied", kind=kind, object=object_id, from_pool=from_pool_id,
                 to_pool=to_pool_id, epoch=epoch, new=made)
        return {"copied": True}


def _first_os_error(group: BaseExceptionGroup[BaseException]) -> OSError | None:
    """An I/O error of the work inside a nursery's group (no KibotosError there)."""
    matched, _ = group.split(OSError)
    if matched is None:
        return None
    leaves: list[BaseException] = list(matched.exceptions)
    while leaves and isinstance(leaves[0], BaseExceptionGroup):
        leaves = list(leaves[0].exceptions)
    first = leaves[0] if leaves else None
    return first if isinstance(first, OSError) else None


def _label(key: Key) -> str:
    kind, pool_id, object_id = key
    name = "retained layer" if kind == RETAINED_LAYERS else "volume"
    return f"{name} {object_id} of pool {pool_id}"
