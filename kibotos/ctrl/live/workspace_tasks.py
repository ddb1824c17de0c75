"""Background work of the Workspace service: finishing stops and deletes on the nodes,
destroying Instances ctrl does not know, telling nodes of drains.

Each stop or delete is recorded first (STOPPING, DELETING), so this work can always be
resumed: a task runs per Workspace and loops until the Workspace left that state,
waiting while the node it needs has no session, and the sweep (`Tasks.sweep`, every
few seconds and at ctrl start) starts one for every such Workspace that has none.  A
stop whose node was isolated ends at once: the isolate made the Workspace FAILED.

The tasks run in the shared nursery of `kibotos.ctrl.live.runtime.Runtime`; their
sweep (`WorkspaceTasks.sweep`) is one of the runtime's sweepers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import partial

from kibotos.core.errors import DeadlineExceeded, KibotosError, NotFound, Unavailable
from kibotos.ctrl.live.runtime import Runtime
from kibotos.ctrl.live.single_flight import SingleFlight
from kibotos.ctrl.model import instances as inst_mod
from kibotos.ctrl.model import workspace_records as w
from kibotos.ctrl.model import workspace_txns as tx
from kibotos.ctrl.pools import operator_writes as pool_ops
from kibotos.ctrl.pools import use_rights
from kibotos.ctrl.pools import volume_attach as va
from kibotos.protocol import Args, DestroyArgs, DrainArgs, LayerDeleteArgs, StopArgs

log = logging.getLogger("kibotos.ctrl.model.workspace_records")

#: The stop's guest deadline, and how much longer ctrl waits for the node's answer.
STOP_DEADLINE_S = 30.0
STOP_MARGIN_S = 60.0
DESTROY_TIMEOUT = 120.0
LAYER_DELETE_TIMEOUT = 120.0
DRAIN_TIMEOUT = 10.0
#: Pause before trying a node again that could not be reached.
RETRY_PAUSE = 2.0


class WorkspaceTasks:
    """The Workspace service's background work, on the shared `Runtime`."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.ctx = runtime.ctx
        self.store = runtime.store
        self._active: SingleFlight[str] = SingleFlight()

    def follow(self, followups: Iterable[inst_mod.Followup]) -> None:
        """Start what the store's Instance rules asked for (`instances.Followup`)."""
        spawn = self.runtime.spawn
        for f in followups:
            if f.action == "stop" and f.workspace_id is not None:
                spawn(self.stop, f.workspace_id)
            elif f.action == "destroy":
                spawn(self.destroy_orphan, f.node_id, f.instance_id)
            elif f.action == "discard":
                spawn(self.discard, f.node_id, f.instance_id)

    def orphaned(self, node_id: str, instance_id: str) -> None:
        """A node may hold an Instance ctrl did not record: destroy it in the
        background (`destroy_orphan`)."""
        self.runtime.spawn(self.destroy_orphan, node_id, instance_id)

    async def sweep(self) -> None:
        """Start a task for every STOPPING or DELETING Workspace that has none."""
        for workspace_id, state in await self.store.run(tx.pending_operations):
            if workspace_id not in self._active:
                self.runtime.spawn(self.stop if state == w.STOPPING else self.delete,
                                   workspace_id)

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
        store, now = self.store, self.ctx.now
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
                await self.runtime.wait_node_change(RETRY_PAUSE)
                continue
            await store.write(partial(
                tx.stop_done, workspace_id=workspace_id, instance_id=instance_id,
                confirmed=bool(result.get("confirmed_on_disk")), node_id=node_id, now=now()))
            return

    # ------------------------------------------------------------------ delete

    async def delete(self, workspace_id: str) -> None:
        await self._active.run(workspace_id, partial(self._delete, workspace_id))

    async def _delete(self, workspace_id: str) -> None:
        store, now = self.store, self.ctx.now
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
                await self.runtime.wait_node_change(RETRY_PAUSE)

    async def _delete_object(self, right: tx.RightPlan) -> bool:
        """Delete one object on a node that can reach its pool; False if none can now."""
        store, now = self.store, self.ctx.now
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
        index = self.runtime.index
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
        pending = self.runtime.inflight.get(instance_id)
        if pending is not None:
            await pending.wait()
        if await self.store.run(partial(tx.instance_known, instance_id=instance_id)):
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
            await self.store.write(partial(
                tx.instance_discarded, instance_id=instance_id, now=self.ctx.now()))

    async def tell_drain(self, node_id: str, requested: bool) -> None:
        result = await self._call(node_id, DrainArgs(requested=requested), DRAIN_TIMEOUT)
        if result is None:
            log.info("node %s: drain=%s not delivered now; the next welcome carries it",
                     node_id, requested)
