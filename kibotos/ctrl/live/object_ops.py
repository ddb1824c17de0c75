"""Expansions and moves of Volumes and writable layers (docs/storage.md, "Volumes";
spec: storage-pools-on-nfs, "Notes" and "Troubleshooting").

* Expand: ``object.expand{kind, pool_id, object_id, epoch, capacity_bytes}`` goes to
  the object's holder, or to a live node attached to its pool (which is granted the
  use right first, with the epoch rules of `use_rights`).  The node runs ``e2fsck``
  and ``resize2fs`` on the block file, up to 45 minutes, so ctrl records the
  operation first and waits in a background task; the request answers at once and
  the CLI follows it.  A failure is recorded on the operation (``failed``, with the
  node's error); the next expansion must ask for at least that target and continues
  from the block file's state.
* Move: ``object.copy{kind, object_id, from_pool_id, to_pool_id, epoch}`` on a node
  attached to both pools (none is ``failed_precondition`` "no node connects to both
  pools"); once copied, the object's record and use right switch to the new pool, and
  the old copy is deleted (``volume.delete`` / ``layer.delete`` in the old pool).

Both need the object's Workspace stopped and keep it from starting until they end.
The nodes are chosen and called through `VolumeService` (`usable_nodes`, `call`), whose
readers `changed` wakes; the tasks run on the shared `Runtime`.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from kibotos.core.errors import FailedPrecondition, KibotosError
from kibotos.ctrl.live.runtime import Runtime
from kibotos.ctrl.live.single_flight import SingleFlight
from kibotos.ctrl.live.volume_service import VolumeService
from kibotos.ctrl.pools import object_op_txns as ot
from kibotos.ctrl.wire.volumes import ExpandIn, MoveIn
from kibotos.protocol import (
    Args,
    LayerDeleteArgs,
    ObjectCopyArgs,
    ObjectExpandArgs,
    ObjectKind,
    VolumeDeleteArgs,
)

log = logging.getLogger("kibotos.ctrl.live.volume_service")

#: The node's limit for a whole expansion is 45 minutes; ctrl waits a little longer.
EXPAND_TIMEOUT = 45 * 60 + 120.0
#: A copy streams the whole block file (sparse) from one pool to the other.
COPY_TIMEOUT = 6 * 3600.0
DELETE_TIMEOUT = 120.0
RETRY_PAUSE = 2.0


class ObjectOps:
    """Expansions and moves on the shared `Runtime`, beside `VolumeService`."""

    def __init__(self, runtime: Runtime, volumes: VolumeService) -> None:
        self.runtime = runtime
        self.volumes = volumes
        self.ctx = runtime.ctx
        self.store = runtime.store
        self.journal = runtime.journal
        self._active: SingleFlight[tuple[str, str]] = SingleFlight()

    def _operation(self, kind: str, verb: str) -> str:
        return f"{'volume' if kind == ot.VOLUME else 'workspace.layer'}.{verb}"

    def _params(self, kind: str, name: str) -> dict[str, Any]:
        return {"volume_id": name} if kind == ot.VOLUME else {"workspace_id": name}

    # ------------------------------------------------------------------ requests

    async def expand(self, kind: str, name: str, body: ExpandIn,
                     identity_id: str | None) -> dict[str, Any]:
        self.runtime.require_running()
        outcome = await self.journal.execute(
            operation=self._operation(kind, "expand"), params=self._params(kind, name),
            body=body, identity_id=identity_id,
            fn=partial(ot.begin_expand, kind=kind, name=name,
                       capacity_bytes=body.capacity_bytes, expected=body.expected_version,
                       now=self.ctx.now(), default_capacity=self.runtime.default_capacity))
        await self._started(kind, name)
        return outcome.result

    async def move(self, kind: str, name: str, body: MoveIn,
                   identity_id: str | None) -> dict[str, Any]:
        self.runtime.require_running()
        operation, params = self._operation(kind, "move"), self._params(kind, name)
        journal = self.journal
        replay = await journal.lookup(operation=operation, params=params, body=body)
        if replay is not None:
            return replay.result
        async with journal.refusals(operation=operation, params=params, body=body,
                                    identity_id=identity_id):
            self.runtime.watch.drain()
            subject = await self.store.run(partial(ot.subject_of, kind=kind, name=name))
            node_id = self._copier(subject.pool_id, body.pool_id, subject.object_id)
        outcome = await journal.execute(
            operation=operation, params=params, body=body, identity_id=identity_id,
            fn=partial(ot.begin_move, kind=kind, name=name, pool_id=body.pool_id,
                       node_id=node_id, expected=body.expected_version, now=self.ctx.now(),
                       default_capacity=self.runtime.default_capacity))
        await self._started(kind, name)
        return outcome.result

    def _copier(self, from_pool: str, to_pool: str, object_id: str) -> str:
        nodes = self.volumes.usable_nodes([from_pool, to_pool])
        if not nodes:
            raise FailedPrecondition(
                f"no node connects to both pools {from_pool} and {to_pool}: mount the "
                f"target pool on a node attached to {from_pool}, declare it in that "
                "node's configuration and restart it, then move",
                details={"from_pool_id": from_pool, "to_pool_id": to_pool,
                         "object_id": object_id})
        return nodes[0]

    async def _started(self, kind: str, name: str) -> None:
        subject = await self.store.run(partial(ot.subject_of, kind=kind, name=name))
        self.runtime.spawn(self.run, kind, subject.object_id)
        self.volumes.changed()

    async def status(self, kind: str, name: str) -> dict[str, Any]:
        return await self.store.run(partial(ot.status_json, kind=kind, name=name))

    # ------------------------------------------------------------------ tasks

    async def sweep(self) -> None:
        for kind, object_id in await self.store.run(ot.pending):
            if (kind, object_id) not in self._active:
                self.runtime.spawn(self.run, kind, object_id)

    async def run(self, kind: str, object_id: str) -> None:
        await self._active.run((kind, object_id), partial(self._run, kind, object_id),
                               after=self.volumes.changed)

    async def _run(self, kind: str, object_id: str) -> None:
        while True:
            state = await self.store.run(partial(ot.op_state, kind=kind,
                                                 object_id=object_id))
            if state is None:
                return
            if not await self._step(state):
                await self.runtime.wait_node_change(RETRY_PAUSE)

    async def _step(self, state: ot.OpState) -> bool:
        """One step of the operation; False when no node could do it now."""
        store, now = self.store, self.ctx.now
        if state.status == "cleanup":
            return await self._cleanup(state)
        pools = [state.pool_id] if state.target_pool_id is None else [
            state.pool_id, state.target_pool_id]
        if state.op == ot.EXPAND and state.holder_node_id is not None:
            prefer = [state.holder_node_id]  # the holder, and only the holder
        else:
            prefer = [n for n in (state.node_id, state.last_holder_node_id) if n]
        nodes = self.volumes.usable_nodes(pools, prefer=prefer)
        if state.op == ot.EXPAND and state.holder_node_id is not None:
            nodes = [n for n in nodes if n == state.holder_node_id]
        if not nodes:
            return False
        node_id = nodes[0]
        epoch = await store.write(partial(ot.grant_for_op, kind=state.kind,
                                          object_id=state.object_id, node_id=node_id,
                                          now=now()))
        if epoch is None:
            return True
        try:
            if state.op == ot.EXPAND:
                assert state.target_capacity_bytes is not None
                result = await self.volumes.call(node_id, ObjectExpandArgs(
                    kind=ObjectKind(state.kind), pool_id=state.pool_id,
                    object_id=state.object_id, epoch=epoch,
                    capacity_bytes=state.target_capacity_bytes), EXPAND_TIMEOUT)
            else:
                assert state.target_pool_id is not None
                result = await self.volumes.call(node_id, ObjectCopyArgs(
                    kind=ObjectKind(state.kind), object_id=state.object_id,
                    from_pool_id=state.pool_id, to_pool_id=state.target_pool_id,
                    epoch=epoch), COPY_TIMEOUT)
        except KibotosError as exc:
            log.warning("node %s: %s of %s %s failed: %s", node_id, state.op, state.kind,
                        state.object_id, exc.message)
            await store.write(partial(ot.op_failed, kind=state.kind,
                                      object_id=state.object_id, message=exc.message,
                                      now=now()))
            return True
        if result is None:
            return False
        if state.op == ot.EXPAND:
            got = result.get("capacity_bytes")
            capacity = got if isinstance(got, int) else state.target_capacity_bytes
            assert capacity is not None
            await store.write(partial(ot.expand_done, kind=state.kind,
                                      object_id=state.object_id, capacity_bytes=capacity,
                                      now=now()))
        else:
            assert state.target_pool_id is not None
            await store.write(partial(
                ot.move_switch, kind=state.kind, object_id=state.object_id,
                shared=self.volumes.pool_shared(node_id, state.target_pool_id), now=now()))
        return True

    async def _cleanup(self, state: ot.OpState) -> bool:
        """Delete the old copy of a moved object in its old pool."""
        prefer = [state.node_id] if state.node_id else []
        nodes = self.volumes.usable_nodes([state.pool_id], prefer=prefer)
        if not nodes or state.epoch is None:
            return False
        node_id = nodes[0]
        args: Args
        if state.kind == ot.VOLUME:
            args = VolumeDeleteArgs(volume_id=state.object_id, pool_id=state.pool_id,
                                    epoch=state.epoch)
        else:
            args = LayerDeleteArgs(pool_id=state.pool_id, ref=state.object_id,
                                   epoch=state.epoch)
        try:
            result = await self.volumes.call(node_id, args, DELETE_TIMEOUT)
        except KibotosError as exc:
            log.warning("node %s could not delete the old copy of %s %s in pool %s: %s",
                        node_id, state.kind, state.object_id, state.pool_id, exc.message)
            return False
        if result is None:
            return False
        await self.store.write(partial(ot.move_done, kind=state.kind,
                                       object_id=state.object_id, now=self.ctx.now()))
        return True
