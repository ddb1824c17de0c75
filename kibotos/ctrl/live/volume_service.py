"""The Volume service: create, get, list and delete Volumes, talking to the nodes that
make and remove their block files (docs/storage.md, "Volumes").

A create picks a live node attached to the pool (not drained: the Volume's use right
would keep it from draining), records the Volume CREATING with its use right granted to
that node at a new epoch (capacity checked in the same transaction), and answers; a
background task sends ``volume.create`` and moves the Volume to AVAILABLE, or FAILED
with the node's reason.  A delete is refused while a Workspace that is not DELETED has
the Volume attached; it records DELETING and a task sends ``volume.delete`` to the
holder, or to any live node attached to the pool (granting it the use right first).
Tasks retry while no node can be reached, also after a ctrl restart (`sweep`, one of
the shared runtime's sweepers, resumes them), as Workspace stops and deletes do.

Attaching at Workspace create, the Volumes' part of a start and the detach at Workspace
delete are in `workspace_service`/`workspace_tasks`, through `volume_attach`; expansions
and moves of Volumes and writable layers are in `object_ops`, Transfers in
`transfer_service`: both choose their nodes and send their commands through this
service's `usable_nodes` and `call`, and wake its readers with `changed`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import trio

from kibotos.core import ids
from kibotos.core.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KibotosError,
    Unavailable,
)
from kibotos.ctrl.live.runtime import Runtime
from kibotos.ctrl.live.single_flight import SingleFlight
from kibotos.ctrl.model import workspace_txns as tx
from kibotos.ctrl.pools import volume_txns as vt
from kibotos.ctrl.wire.base import VersionedWrite
from kibotos.ctrl.wire.volumes import VolumeCreateIn
from kibotos.protocol import Args, VolumeCreateArgs, VolumeDeleteArgs

log = logging.getLogger("kibotos.ctrl.live.volume_service")

#: ``volume.create`` truncates and formats a sparse file; ``volume.delete`` unlinks.
CREATE_TIMEOUT = 300.0
DELETE_TIMEOUT = 120.0
RETRY_PAUSE = 2.0
#: How long to leave a node that is still working on the object before asking again.
BUSY_PAUSE = 10.0


class VolumeService:
    """Volumes on the shared `Runtime`: its tasks run in the runtime's nursery, its
    `sweep` with the runtime's."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.ctx = runtime.ctx
        self.store = runtime.store
        self.journal = runtime.journal
        self._active: SingleFlight[str] = SingleFlight()
        self._changed = trio.Event()

    @property
    def default_capacity(self) -> int | None:
        return self.runtime.default_capacity

    def changed(self) -> None:
        """Wake readers waiting for a settled Volume (`get` with ``wait_s``)."""
        self._changed.set()
        self._changed = trio.Event()

    # ------------------------------------------------------------------ nodes

    def usable_nodes(self, pools: Iterable[str], *, prefer: Sequence[str] = (),
                     drained_ok: bool = True) -> list[str]:
        """Live nodes (session alive, not isolated, retired or revoked) that report
        every pool in `pools` available; `prefer` first, then in ID order."""
        wanted = set(pools)
        index = self.runtime.index
        order = [n for n in prefer if n] + sorted(n for n in index.nodes if n not in prefer)
        out = []
        for node_id in order:
            entry = index.nodes.get(node_id)
            if entry is None or node_id in out or not self.ctx.sessions.is_alive(node_id):
                continue
            facts = entry.facts
            if facts.isolated_incarnation is not None or facts.retired_at is not None \
                    or facts.admission != "admitted":
                continue
            if facts.drain_requested and not drained_ok:
                continue
            if all((p := entry.pools.get(pool)) is not None and p.available
                   for pool in wanted):
                out.append(node_id)
        return out

    def placing_nodes(self, pool_id: str | None, verb: str) -> tuple[str, list[str]]:
        """Where a new Volume goes (a create, an import): `pool_id` or the default pool,
        and the nodes that can make it there, the latest facts first; none is
        `FailedPrecondition` (`verb` says what they cannot do)."""
        self.runtime.watch.drain()
        pool = pool_id or self.default_pool()
        nodes = self.usable_nodes([pool], drained_ok=False)
        if not nodes:
            raise FailedPrecondition(
                f"no live node attached to pool {pool} can {verb} the Volume "
                "(nodes must be connected, not drained, and report the pool available)",
                details={"pool_id": pool})
        return pool, nodes

    def default_pool(self) -> str:
        """The one default pool of the live nodes that are not drained (a create or
        import that names no pool goes there); none or several is refused."""
        defaults = sorted({entry.default_pool.pool_id for node_id, entry
                           in self.runtime.index.nodes.items()
                           if entry.default_pool is not None
                           and node_id in self.usable_nodes((), drained_ok=False)})
        if len(defaults) == 1:
            return defaults[0]
        if not defaults:
            raise FailedPrecondition("no live node reports a default storage pool: give "
                                     "the pool (--pool)")
        raise InvalidArgument("the live nodes have several default pools "
                              f"({', '.join(defaults)}): give the pool (--pool)",
                              details={"pools": defaults})

    def pool_shared(self, node_id: str, pool_id: str) -> bool:
        entry = self.runtime.index.nodes.get(node_id)
        fact = entry.pools.get(pool_id) if entry is not None else None
        return bool(fact is not None and fact.shared)

    # ------------------------------------------------------------------ create

    async def create(self, body: VolumeCreateIn, identity_id: str | None) -> dict[str, Any]:
        self.runtime.require_running()
        replay = await self.journal.lookup(operation="volume.create", params={}, body=body)
        if replay is not None:
            return replay.result
        async with self.journal.refusals(operation="volume.create", params={}, body=body,
                                         identity_id=identity_id):
            pool_id, nodes = self.placing_nodes(body.pool_id, "create")
        node_id = nodes[0]
        volume_id = ids.new_id("vol")
        outcome = await self.journal.execute(
            operation="volume.create", params={}, body=body, identity_id=identity_id,
            fn=partial(vt.begin_create, volume_id=volume_id, pool_id=pool_id,
                       shared=self.pool_shared(node_id, pool_id),
                       capacity_bytes=body.capacity_bytes, labels=body.labels,
                       node_id=node_id, now=self.ctx.now(),
                       default_capacity=self.default_capacity))
        if not outcome.replayed:
            self.runtime.spawn(self.finish_create, volume_id)
        return outcome.result

    async def finish_create(self, volume_id: str) -> None:
        await self._active.run(volume_id, partial(self._finish_create, volume_id),
                               after=self.changed)

    async def _finish_create(self, volume_id: str) -> None:
        store, now = self.store, self.ctx.now
        while True:
            target = await store.run(partial(vt.create_target, volume_id=volume_id))
            if target is None:
                return
            node_id, pool_id, capacity, epoch = target
            if node_id not in self.usable_nodes([pool_id]):
                # The chosen node was isolated or retired meanwhile: another node
                # attached to the pool makes it, at a new epoch.
                others = self.usable_nodes([pool_id], drained_ok=False)
                if others and not self._may_return(node_id):
                    await store.write(partial(tx.grant_for_delete, kind="volume",
                                              object_id=volume_id, node_id=others[0],
                                              now=now()))
                    continue
                await self.runtime.wait_node_change(RETRY_PAUSE)
                continue
            try:
                result = await self.call(node_id, VolumeCreateArgs(
                    volume_id=volume_id, pool_id=pool_id, capacity_bytes=capacity,
                    epoch=epoch), CREATE_TIMEOUT)
            except KibotosError as exc:
                log.warning("node %s could not create volume %s: %s", node_id, volume_id,
                            exc.message)
                await store.write(partial(vt.create_failed, volume_id=volume_id,
                                          message=exc.message, now=now()))
                return
            if result is None:
                await self.runtime.wait_node_change(RETRY_PAUSE)
                continue
            await store.write(partial(vt.create_done, volume_id=volume_id, node_id=node_id,
                                      now=now()))
            return

    def _may_return(self, node_id: str) -> bool:
        """A node that is only disconnected may come back; an isolated, retired or
        revoked one will not hold the use right again at this epoch."""
        entry = self.runtime.index.nodes.get(node_id)
        if entry is None:
            return False
        facts = entry.facts
        return facts.isolated_incarnation is None and facts.retired_at is None \
            and facts.admission == "admitted"

    async def call(self, node_id: str, args: Args, timeout: float
                   ) -> dict[str, object] | None:
        """A node command; None when the node cannot be reached right now, answers
        that the object's lock is held (``aborted``), or is still working on the object
        (``object_busy``: e.g. an expansion that went on while
        the session was down, asked again).  Other errors are the node's verdict and
        are raised."""
        if not self.ctx.sessions.is_alive(node_id):
            return None
        try:
            result: dict[str, object] = await self.ctx.sessions.call(node_id, args, timeout)
            return result
        except (Unavailable, DeadlineExceeded, Aborted) as exc:
            # Aborted: e.g. the object's lock is held on the node (object_lock_held).
            log.info("node %s: %s not done yet: %s", node_id, args.KIND, exc.message)
            return None
        except FailedPrecondition as exc:
            if exc.details.get("reason") != "object_busy":
                raise
            log.info("node %s: %s: %s", node_id, args.KIND, exc.message)
            await trio.sleep(BUSY_PAUSE)
            return None

    # ------------------------------------------------------------------ delete

    async def delete(self, volume_id: str, body: VersionedWrite,
                     identity_id: str | None) -> dict[str, Any]:
        self.runtime.require_running()
        outcome = await self.journal.execute(
            operation="volume.delete", params={"volume_id": volume_id}, body=body,
            identity_id=identity_id,
            fn=partial(vt.begin_delete, volume_id=volume_id, expected=body.expected_version,
                       now=self.ctx.now()))
        if outcome.result.get("state") == vt.DELETING:
            self.runtime.spawn(self.finish_delete, volume_id)
        self.changed()
        return outcome.result

    async def finish_delete(self, volume_id: str) -> None:
        await self._active.run(volume_id, partial(self._finish_delete, volume_id),
                               after=self.changed)

    async def _finish_delete(self, volume_id: str) -> None:
        store, now = self.store, self.ctx.now
        while True:
            right = await store.run(partial(vt.delete_plan, volume_id=volume_id))
            if right is None:
                return
            prefer = [right.holder_node_id or right.last_holder_node_id or ""]
            nodes = self.usable_nodes([right.pool_id], prefer=prefer)
            if right.holder_node_id is not None:
                nodes = [n for n in nodes if n == right.holder_node_id]
            if not nodes:
                await self.runtime.wait_node_change(RETRY_PAUSE)
                continue
            node_id = nodes[0]
            epoch = await store.write(partial(tx.grant_for_delete, kind="volume",
                                              object_id=volume_id, node_id=node_id,
                                              now=now()))
            if epoch is None:
                continue  # the right went meanwhile: the plan says what is left
            try:
                result = await self.call(node_id, VolumeDeleteArgs(
                    volume_id=volume_id, pool_id=right.pool_id, epoch=epoch), DELETE_TIMEOUT)
            except KibotosError as exc:
                # E.g. still open in an Instance the node has not released yet: the
                # node's word is final only for it; try again a little later.
                log.warning("node %s refused to delete volume %s: %s", node_id, volume_id,
                            exc.message)
                result = None
            if result is None:
                await self.runtime.wait_node_change(RETRY_PAUSE)
                continue
            await store.write(partial(vt.delete_done, volume_id=volume_id, now=now()))
            return

    # ------------------------------------------------------------------ reads, sweep

    async def get(self, volume_id: str, wait_s: float = 0.0) -> dict[str, Any]:
        """The Volume; with `wait_s`, once it is settled (and no operation runs on it)
        or that time has passed."""
        deadline = trio.current_time() + wait_s
        while True:
            changed = self._changed
            result = await self.store.run(partial(vt.get_json, volume_id=volume_id))
            op = result.get("operation")
            busy = op is not None and op.get("status") in vt.BUSY
            remaining = deadline - trio.current_time()
            if (result["state"] in vt.SETTLED and not busy) or remaining <= 0:
                return result
            with trio.move_on_after(min(remaining, 1.0)):
                await changed.wait()

    async def sweep(self) -> None:
        """Resume every create and delete that has no task (ctrl start, lost tasks)."""
        for volume_id, state in await self.store.run(vt.pending):
            if volume_id not in self._active:
                self.runtime.spawn(self.finish_create if state == vt.CREATING
                                   else self.finish_delete, volume_id)
