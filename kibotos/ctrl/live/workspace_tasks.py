"""Background work of the Workspace service: finishing stops and deletes on the nodes,
destroying Instances ctrl does not know, telling nodes of drains.

Each stop or delete is recorded first (STOPPING, DELETING), so this work can always be
resumed: a task runs per Workspace and loops until the Workspace left that state,
waiting while the node it needs has no session, and the sweep (`Tasks.sweep`, every
few seconds and at ctrl start) starts one for every such Workspace that has none.  A
stop whose node was isolated ends at once: the isolate made the Workspace FAILED.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from kibotos.ctrl.live.single_flight import SingleFlight
from kibotos.ctrl.model import instances as inst_mod
from kibotos.ctrl.model import workspace_records as w
from kibotos.ctrl.model import workspace_txns as tx
from kibotos.ctrl.pools import operator_writes as pool_ops
from kibotos.ctrl.pools import use_rights
from kibotos.ctrl.pools import volume_attach as va
from kibotos.errors import DeadlineExceeded, KibotosError, NotFound, Unavailable
from kibotos.protocol import Args, DestroyArgs, DrainArgs, LayerDeleteArgs, StopArgs

if TYPE_CHECKING:
    from kibotos.ctrl.live.workspace_service import WorkspaceService

log = logging.getLogger("kibotos.ctrl.model.workspace_records")

#: The stop's guest deadline, and how much longer ctrl waits for the node's answer.
STOP_DEADLINE_S = 30.0
STOP_MARGIN_S = 60.0
DESTROY_TIMEOUT = 120.0
LAYER_DELETE_TIMEOUT = 120.0
DRAIN_TIMEOUT = 10.0
#: Pause before trying a node again that could not be reached.
RETRY_PAUSE = 2.0


class Tasks:
    def __init__(self, service: WorkspaceService) -> None:
        self.service = service
        self.nursery: trio.Nursery | None = None
        self._active: SingleFlight[str] = SingleFlight()
        #: Other parts' resumptions (Volumes, object operations), run with the sweep.
        self.sweepers: list[Callable[[], Awaitable[None]]] = []

    @property
    def ctx(self) -> Any:
        return self.service.ctx

    def spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run `fn` in the background; without a running service the sweep picks the
        work up once it runs (stops and deletes are recorded in the store)."""
        if self.nursery is not None:
            self.nursery.start_soon(self._guard, fn, *args)

    async def _guard(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await fn(*args)
        except KibotosError as exc:
            log.warning("%s%r failed: %s", fn.__name__, args, exc.message)
        except Exception:
            log.exception("%s%r failed", fn.__name__, args)

    def wake(self) -> None:
        """A session started or ended: let waiting tasks look again now."""
        self.spawn(self.sweep)

    def follow(self, followups: Iterable[inst_mod.Followup]) -> None:
        for f in followups:
            if f.action == "stop" and f.workspace_id is not None:
                self.spawn(self.stop, f.workspace_id)
            elif f.action == "destroy":
                self.spawn(self.destroy_orphan, f.node_id, f.instance_id)
            elif f.action == "discard":
                self.spawn(self.discard, f.node_id, f.instance_id)

    async def sweep(self) -> None:
        for workspace_id, state in await self.service.store.run(tx.pending_operations):
            if workspace_id not in self._active:
                self.spawn(self.stop if state == w.STOPPING else self.delete, workspace_id)
        for sweeper in self.sweepers:
            await sweeper()

    async def _call(self, node_id: str, args: Args, timeout: float
                    ) -> dict[str, object] | None:
        """A node command; None when the node cannot be reached right now."""
        if not self.ctx.sessions.is_alive(node_id):
            return None
        try:
            result: dict[str, object] = await self.ctx.sessions.call(node_id, args, timeout)
            return result
        except (Unavailable, DeadlineExceeded) as exc:
            log.info("node %s: %s not done yet: %s", node_id, args.KIND, exc.message)
            return None

    # ------------------------------------------------------------------ stop

    async def stop(self, workspace_id: str) -> None:
        await self._active.run(workspace_id, partial(self._stop, workspace_id))

    async def _stop(self, workspace_id: str) -> None:
        store, now = self.service.store, self.ctx.now
        while True:
            state = await store.run(partial(tx.stop_state, workspace_id=workspace_id))
            if state is None or state[0] != w.STOPPING:
                return
            _, instance_id, node_id, executing, force = state
            if not executing or instance_id is None or node_id is None:
                await store.write(partial(tx.stop_nothing, workspace_id=workspace_id,
                                          now=now()))
                return
            try:
                result = await self._call(
                    node_id, StopArgs(instance_id=instance_id, force=force,
                                      deadline_s=STOP_DEADLINE_S),
                    STOP_DEADLINE_S + STOP_MARGIN_S)
            except NotFound:
                result = {"confirmed_on_disk": False}  # nothing of it is on the node
            except KibotosError as exc:
                await store.write(partial(tx.stop_failed, workspace_id=workspace_id,
                                          instance_id=instance_id, message=exc.message,
                                          now=now()))
                return
            if result is None:
                await self.service.wait_node_change(RETRY_PAUSE)
                continue
            await store.write(partial(
                tx.stop_done, workspace_id=workspace_id, instance_id=instance_id,
                confirmed=bool(result.get("confirmed_on_disk")), node_id=node_id, now=now()))
            return

    # ------------------------------------------------------------------ delete

    async def delete(self, workspace_id: str) -> None:
        await self._active.run(workspace_id, partial(self._delete, workspace_id))

    async def _delete(self, workspace_id: str) -> None:
        store, now = self.service.store, self.ctx.now
        while True:
            state = await store.run(partial(tx.delete_state, workspace_id=workspace_id))
            if state is None or state.state != w.DELETING:
                return
            progressed = False
            if state.executing and state.instance_id and state.node_id:
                result = await self._call(state.node_id,
                                          DestroyArgs(instance_id=state.instance_id),
                                          DESTROY_TIMEOUT)
                if result is not None:
                    await store.write(partial(tx.instance_destroyed, workspace_id=workspace_id,
                                              instance_id=state.instance_id, now=now()))
                    progressed = True
            else:
                for right in state.rights:
                    progressed |= await self._delete_object(right)
                if await store.write(partial(tx.finish_delete, workspace_id=workspace_id,
                                             now=now())):
                    return
            if not progressed:
                await self.service.wait_node_change(RETRY_PAUSE)

    async def _delete_object(self, right: tx.RightPlan) -> bool:
        """Delete one object on a node that can reach its pool; False if none can now."""
        store, now = self.service.store, self.ctx.now
        if right.kind != use_rights.RETAINED_LAYER:
            # A Volume outlives its Workspace: it is detached, not deleted.
            await store.write(partial(va.detach, volume_id=right.object_id, now=now()))
            return True
        node_id = self._node_for(right)
        if node_id is None:
            # Nothing to delete on a node when the pool was declared lost.
            return bool(await store.write(partial(
                pool_ops.forget_lost_object, kind=right.kind, object_id=right.object_id)))
        epoch = await store.write(partial(tx.grant_for_delete, kind=right.kind,
                                          object_id=right.object_id, node_id=node_id,
                                          now=now()))
        if epoch is None:
            return True
        result = await self._call(node_id, LayerDeleteArgs(
            pool_id=right.pool_id, ref=right.object_id, epoch=epoch), LAYER_DELETE_TIMEOUT)
        if result is None:
            return False
        await store.write(partial(tx.object_deleted, kind=right.kind,
                                  object_id=right.object_id))
        return True

    def _node_for(self, right: tx.RightPlan) -> str | None:
        """The holder if it is connected; else a connected node attached to the pool,
        the last holder first.  Drained nodes delete too (spec: a drain only stops new
        Workspaces)."""
        index = self.service.index
        preferred = [right.holder_node_id] if right.holder_node_id else [
            n for n in (right.last_holder_node_id,) if n]
        others = sorted(n for n in index.nodes if n not in preferred)
        for node_id in (*preferred, *([] if right.holder_node_id else others)):
            entry = index.nodes.get(node_id)
            if entry is None or not self.ctx.sessions.is_alive(node_id):
                continue
            facts = entry.facts
            if facts.isolated_incarnation is not None or facts.retired_at is not None:
                continue
            pool = entry.pools.get(right.pool_id)
            if pool is not None and pool.available:
                return node_id
        return None

    # ------------------------------------------------------------------ others

    async def destroy_orphan(self, node_id: str, instance_id: str) -> None:
        """Destroy an Instance the node runs but ctrl has no record of (a create ctrl
        gave up on), unless a create in flight records it after all."""
        pending = self.service.inflight.get(instance_id)
        if pending is not None:
            await pending.wait()
        if await self.service.store.run(partial(tx.instance_known, instance_id=instance_id)):
            return
        log.info("node %s: destroying Instance %s, which ctrl has no record of",
                 node_id, instance_id)
        await self._call(node_id, DestroyArgs(instance_id=instance_id), DESTROY_TIMEOUT)

    async def discard(self, node_id: str, instance_id: str) -> None:
        """Destroy an Instance ctrl knows but no longer wants (not its Workspace's
        current one) and record that nothing of it is left."""
        log.info("node %s: destroying Instance %s, which is no longer wanted",
                 node_id, instance_id)
        if await self._call(node_id, DestroyArgs(instance_id=instance_id),
                            DESTROY_TIMEOUT) is not None:
            await self.service.store.write(partial(
                tx.instance_discarded, instance_id=instance_id, now=self.ctx.now()))

    async def tell_drain(self, node_id: str, requested: bool) -> None:
        result = await self._call(node_id, DrainArgs(requested=requested), DRAIN_TIMEOUT)
        if result is None:
            log.info("node %s: drain=%s not delivered now; the next welcome carries it",
                     node_id, requested)
