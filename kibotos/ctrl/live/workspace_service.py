"""The Workspace service: placement of creates and starts, and the operations that talk
to nodes (docs/workspaces.md).

A create or start *places first*: admission and ranking pick a node from the
in-memory `CapacityIndex`, the capacity is reserved, and ``instance.create`` goes to the
node, which admits it again and answers at once.  Only an accepted Instance is recorded
(Workspace, Instance, Allocation, use rights, events and the command journal in one
transaction), so a create that no node takes leaves nothing behind.  A node that
refuses because its memory turned tight (or it was drained meanwhile, or its session
dropped) is skipped and the next candidate tried at once; none left is
``resource_exhausted``.  ``--node`` makes one node the only candidate.  The boot goes
on on the node; its ``instance_state`` frames move the Workspace on (`instances`).

Stops and deletes are recorded at once (STOPPING, DELETING) and finished by background
tasks (`workspace_tasks`) that call the node and retry while it is away, also after a
ctrl restart.  The service follows the nodes' sessions as a `SessionObserver`; what
nodes say about Instances is applied by `node_feed`, and the candidates of a create or
start are tried by `placement_loop`.  All of them share one `Runtime` (index, journal,
in-flight map, background tasks) and are built together by
`kibotos.ctrl.serve.build_services`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import trio
from sqlalchemy.orm import Session

from kibotos.core import ids
from kibotos.core.errors import DeadlineExceeded, FailedPrecondition, KibotosError, Unavailable
from kibotos.ctrl.live.node_feed import NodeFeed
from kibotos.ctrl.live.placement_loop import Args, Commit, PlacementLoop
from kibotos.ctrl.live.runtime import Runtime
from kibotos.ctrl.live.workspace_tasks import WorkspaceTasks
from kibotos.ctrl.model import network_policy as netpol
from kibotos.ctrl.model import workspace_records as w
from kibotos.ctrl.model import workspace_txns as tx
from kibotos.ctrl.model.egress_grants import GrantScope, PendingGrants
from kibotos.ctrl.model.placement import Demand, NodeEntry
from kibotos.ctrl.pools import capacity as pool_capacity
from kibotos.ctrl.pools import volume_attach as va
from kibotos.ctrl.store.changes import (
    Change,
    NodeSnapshot,
    TemplateSnapshot,
    WorkspaceSnapshot,
)
from kibotos.ctrl.store.models import Instance, Node
from kibotos.ctrl.wire.base import VersionedWrite
from kibotos.ctrl.wire.network import WorkspaceSetNetworkIn
from kibotos.ctrl.wire.workspaces import WorkspaceCreateIn, WorkspaceStartIn, WorkspaceStopIn
from kibotos.protocol import (
    CreateSpec,
    Hello,
    InstanceState,
    LaunchArgs,
    LayerRef,
    NetworkPolicy,
    Report,
    SetNetworkArgs,
    TemplateRef,
    VolumeRef,
)
from kibotos.volume_mounts import default_mount_point

log = logging.getLogger("kibotos.ctrl.model.workspace_records")

#: A network switch is one nftables transaction on the node (and maybe a credentials
#: fetch from ctrl): it answers in well under this.
SWITCH_TIMEOUT = 30.0


class WorkspaceService:
    """Workspaces on the shared `Runtime`, with its tasks, feed and placement loop."""

    def __init__(self, runtime: Runtime, *, tasks: WorkspaceTasks, feed: NodeFeed,
                 placement: PlacementLoop) -> None:
        self.runtime = runtime
        self.ctx = runtime.ctx
        self.store = runtime.store
        self.journal = runtime.journal
        self.tasks = tasks
        self.feed = feed
        self.placement = placement
        self._locks: dict[str, tuple[trio.Lock, int]] = {}
        self._ws_changed = trio.Event()
        self._drain_known: dict[str, bool] = {}
        self._templates: dict[str, dict[str, str]] = {}
        #: Egress revisions out to a node before the store records them.
        self.egress_grants = PendingGrants()
        runtime.watch.subscribe(self._on_changes)

    def _on_changes(self, batch: list[Change]) -> None:
        """After the runtime's index took the batch: the Template cache, readers
        waiting for a Workspace to settle, and the nodes' drain flags."""
        for change in batch:
            if isinstance(change, TemplateSnapshot):
                self._templates.pop(change.name, None)
            elif isinstance(change, WorkspaceSnapshot):
                self._ws_changed.set()
                self._ws_changed = trio.Event()
            elif isinstance(change, NodeSnapshot):
                self._follow_drain(change)

    def _follow_drain(self, node: NodeSnapshot) -> None:
        """Tell a connected node when its drain flag changes (``node.drain``)."""
        flag = bool(node.drain_requested)
        known = self._drain_known.get(node.node_id)
        self._drain_known[node.node_id] = flag
        if known is not None and known != flag and node.session_alive:
            self.runtime.spawn(self.tasks.tell_drain, node.node_id, flag)

    @contextlib.asynccontextmanager
    async def lock(self, workspace_id: str) -> AsyncIterator[None]:
        """One operation at a time per Workspace in this process."""
        lock, users = self._locks.get(workspace_id, (trio.Lock(), 0))
        self._locks[workspace_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[workspace_id]
            if users <= 1:
                del self._locks[workspace_id]
            else:
                self._locks[workspace_id] = (lock, users - 1)

    # ------------------------------------------------------------------ create, start

    async def create(self, body: WorkspaceCreateIn, identity_id: str | None) -> dict[str, Any]:
        self.runtime.require_running()
        journal = partial(self._journaled, "workspace.create", {}, body, identity_id)
        replay = await self.journal.lookup(operation="workspace.create", params={}, body=body)
        if replay is not None:
            return replay.result
        workspace_id, layer_ref = ids.new_id("ws"), ids.new_id("lay")

        async def attempt(grants: GrantScope) -> dict[str, Any]:
            template = await self.template(body.template)
            volumes, network = await self.store.run(partial(
                _create_plan, wanted=[(v.volume_id, v.mount()) for v in body.volumes],
                policy=None if body.network is None else body.network.stored()))
            demand = Demand(body.cpu_millis, body.memory_bytes, None, body.labels,
                            frozenset(v.right.pool_id for v in volumes), network.need)
            default_capacity = self.runtime.default_capacity
            sent: dict[str, NetworkPolicy | None] = {}

            async def args(entry: NodeEntry, instance_id: str) -> CreateSpec:
                assert entry.default_pool is not None
                # Refused before the node is asked: no block file for a full pool.  The
                # candidate's own pool only, so the read does not grow with the cluster.
                room = await self.store.run(partial(pool_capacity.room,
                                                    pool_id=entry.default_pool.pool_id))
                pool_capacity.check_snapshot(room, body.layer_size_bytes, "writable layer",
                                             default_capacity)
                policy = sent[instance_id] = network.for_node(entry.network)
                grants.add(entry.node_id, policy)
                return CreateSpec(
                    network=policy, network_revision=None if policy is None else 1,
                    instance_id=instance_id, workspace_id=workspace_id,
                    template=TemplateRef(**template), cpu_millis=body.cpu_millis,
                    memory_bytes=body.memory_bytes,
                    layer=LayerRef(pool_id=entry.default_pool.pool_id, ref=layer_ref,
                                   capacity_bytes=body.layer_size_bytes, epoch=1,
                                   create=True),
                    volumes=[VolumeRef(volume_id=v.volume_id, pool_id=v.right.pool_id,
                                       epoch=v.right.epoch_for(entry.node_id),
                                       mount_point=v.mount_point) for v in volumes],
                    launch=LaunchArgs(hostname=workspace_id, env={}))

            def commit(node_id: str, instance_id: str) -> Callable[[Session], dict[str, Any]]:
                pool = self.runtime.index.nodes[node_id].default_pool
                assert pool is not None
                return partial(va.commit_create, plans=volumes, workspace_id=workspace_id,
                               template=template, labels=body.labels,
                               cpu_millis=body.cpu_millis, memory_bytes=body.memory_bytes,
                               layer_size_bytes=body.layer_size_bytes, layer_ref=layer_ref,
                               pool_id=pool.pool_id, pool_shared=pool.shared,
                               node_id=node_id, instance_id=instance_id, now=self.ctx.now(),
                               verify=self.verify_in_store,
                               default_capacity=default_capacity, network=network,
                               sent=sent.get(instance_id))

            return await self.place(demand, body.node_id, args, commit, journal)

        return await self._refusing("workspace.create", {}, body, identity_id,
                                    self._granting(attempt))

    async def start(self, workspace_id: str, body: WorkspaceStartIn,
                    identity_id: str | None) -> dict[str, Any]:
        self.runtime.require_running()
        params = {"workspace_id": workspace_id}
        journal = partial(self._journaled, "workspace.start", params, body, identity_id)
        replay = await self.journal.lookup(operation="workspace.start", params=params,
                                           body=body)
        if replay is not None:
            return replay.result

        async def attempt(grants: GrantScope) -> dict[str, Any]:
            async with self.lock(workspace_id):
                plan, mounts = await self.store.run(partial(
                    va.start_plan, workspace_id=workspace_id, expected=body.expected_version))
                network = await self.store.run(partial(netpol.resolve,
                                                       policy=plan.network_policy))
                demand = Demand(plan.cpu_millis, plan.memory_bytes,
                                frozenset(r.pool_id for r in plan.rights), plan.labels,
                                network=network.need)
                sent: dict[str, NetworkPolicy | None] = {}

                async def args(entry: NodeEntry, instance_id: str) -> CreateSpec:
                    layers = [r for r in plan.rights if r.kind == "retained_layer"]
                    layer = layers[0]
                    policy = sent[instance_id] = network.for_node(entry.network)
                    grants.add(entry.node_id, policy)
                    return CreateSpec(
                        network=policy,
                        network_revision=None if policy is None else plan.network_revision,
                        instance_id=instance_id, workspace_id=workspace_id,
                        template=TemplateRef(**plan.template), cpu_millis=plan.cpu_millis,
                        memory_bytes=plan.memory_bytes,
                        layer=LayerRef(pool_id=layer.pool_id, ref=layer.object_id,
                                       capacity_bytes=plan.layer_size_bytes,
                                       epoch=layer.epoch_for(entry.node_id), create=False),
                        volumes=[VolumeRef(volume_id=r.object_id, pool_id=r.pool_id,
                                           epoch=r.epoch_for(entry.node_id),
                                           mount_point=mounts.get(
                                               r.object_id, default_mount_point(r.object_id)))
                                 for r in plan.rights if r.kind == "volume"],
                        launch=LaunchArgs(hostname=workspace_id, env={}))

                def commit(node_id: str,
                           instance_id: str) -> Callable[[Session], dict[str, Any]]:
                    return partial(va.commit_start, plan=plan, expected=body.expected_version,
                                   node_id=node_id, instance_id=instance_id,
                                   now=self.ctx.now(), verify=self.verify_in_store,
                                   network=network, sent=sent.get(instance_id))

                return await self.place(demand, body.node_id, args, commit, journal)

        return await self._refusing("workspace.start", params, body, identity_id,
                                    self._granting(attempt))

    def _granting(self, attempt: Callable[[GrantScope], Awaitable[dict[str, Any]]]
                  ) -> Callable[[], Awaitable[dict[str, Any]]]:
        """`attempt` with the Egress revisions it sends held for the nodes it asks
        until it is over (`egress_grants`)."""

        async def run() -> dict[str, Any]:
            with self.egress_grants.scope() as grants:
                return await attempt(grants)

        return run

    # ------------------------------------------------------------------ network

    async def set_network(self, workspace_id: str, body: WorkspaceSetNetworkIn,
                          identity_id: str | None) -> dict[str, Any]:
        """Replace the Workspace's network policy: a running one's node applies it in
        one transaction first (``instance.set_network``, the new revision), then it is
        recorded; a stopped one just records it for its next start."""
        self.runtime.require_running()
        params = {"workspace_id": workspace_id}
        journal = partial(self._journaled, "workspace.set_network", params, body,
                          identity_id)
        replay = await self.journal.lookup(operation="workspace.set_network",
                                           params=params, body=body)
        if replay is not None:
            return replay.result
        policy = None if body.network is None else body.network.stored()

        async def attempt(grants: GrantScope) -> dict[str, Any]:
            async with self.lock(workspace_id):
                plan = await self.store.run(partial(
                    netpol.switch_plan, workspace_id=workspace_id,
                    expected=body.expected_version, policy=policy))
                sent = await self._switch_on_node(plan, grants)
                result, _ = await journal(partial(
                    netpol.commit_switch, plan=plan, expected=body.expected_version,
                    sent=sent, now=self.ctx.now()))
                return dict(result)

        return await self._refusing("workspace.set_network", params, body, identity_id,
                                    self._granting(attempt))

    def egress_changed(self, name: str) -> None:
        """A new revision of Egress `name` was recorded: switch the running Workspaces
        that use it to it, in the background (each one as a `set-network` with its
        policy unchanged).  One whose node is away keeps the revision it has, which
        stays fetchable, until its next start or switch."""
        self.runtime.spawn(self._refresh_egress_users, name)

    async def _refresh_egress_users(self, name: str) -> None:
        for workspace_id in await self.store.run(partial(netpol.refresh_targets,
                                                         egress=name)):
            try:
                await self._refresh_one(workspace_id, name)
            except KibotosError as exc:
                log.warning("workspace %s keeps its egress %s revision: %s", workspace_id,
                            name, exc.message)

    async def _refresh_one(self, workspace_id: str, name: str) -> None:
        async with self.lock(workspace_id):
            plan = await self.store.run(partial(netpol.refresh_plan,
                                                workspace_id=workspace_id, egress=name))
            if plan is None:
                return
            with self.egress_grants.scope() as grants:
                sent = await self._switch_on_node(plan, grants)
                await self.store.write(partial(
                    netpol.commit_switch, plan=plan, expected=None, sent=sent,
                    now=self.ctx.now(), cause=f"egress {name} changed"))

    async def _switch_on_node(self, plan: netpol.SwitchPlan,
                              grants: GrantScope) -> NetworkPolicy | None:
        """Have the running Instance's node apply the new policy; what it now enforces
        (None: nothing runs, or it runs without a network under the default policy)."""
        if plan.instance_id is None or plan.node_id is None:
            return None
        self.runtime.watch.drain()
        entry = self.runtime.index.nodes.get(plan.node_id)
        network = entry.network if entry is not None else None
        details = {"workspace_id": plan.workspace_id, "node_id": plan.node_id}
        why = netpol.refusal(plan.resolved.need, network)
        if why is not None:
            raise FailedPrecondition(
                f"workspace {plan.workspace_id} runs on node {plan.node_id}, which cannot "
                f"enforce this policy ({why}): stop it, set its network, and start it "
                "again (placement then picks a node that can)", details=details)
        sent = plan.resolved.for_node(network)
        if sent is None:
            return None
        if not plan.instance_has_network:
            raise FailedPrecondition(
                f"workspace {plan.workspace_id} runs as Instance {plan.instance_id}, which "
                "was started without a network: stop it and start it again to give it one",
                details=details)
        # The revision is reserved before the node may fetch the Egress's credentials
        # for it: the grant is open only while the node is being asked.
        await self.store.write(partial(netpol.reserve_revision, plan=plan))
        grants.add(plan.node_id, sent)
        try:
            await self.ctx.sessions.call(
                plan.node_id, SetNetworkArgs(instance_id=plan.instance_id, network=sent,
                                             revision=plan.network_revision), SWITCH_TIMEOUT)
        except (DeadlineExceeded, Unavailable):
            raise  # no answer: the node may have applied it, so the revision stays used
        except KibotosError:
            await self.store.write(partial(netpol.release_revision, plan=plan))
            raise
        return sent

    async def template(self, name: str) -> dict[str, str]:
        """A Template's digests; cached, and dropped from the cache when any commit
        writes or deletes that Template (`StoreWatch`)."""
        cached = self._templates.get(name)
        if cached is None:
            cached = await self.store.run(partial(tx.template_of, name=name))
            self._templates[name] = cached
        return dict(cached)

    @property
    def verify_in_store(self) -> bool:
        """Check the chosen node in the store as well as in the index (`tx.verify_node`):
        needed when several ctrl replicas share a PostgreSQL store.  One SQLite database
        serves one ctrl, whose index sees every placement, so there it is skipped."""
        return self.store.engine.dialect.name != "sqlite"

    async def _journaled(self, operation: str, params: dict[str, Any], body: Any,
                         identity_id: str | None,
                         fn: Callable[[Session], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
        outcome = await self.journal.execute(operation=operation, params=params, body=body,
                                             identity_id=identity_id, fn=fn)
        return outcome.result, outcome.replayed

    async def _refusing(self, operation: str, params: dict[str, Any], body: Any,
                        identity_id: str | None, attempt: Callable[[], Any]) -> dict[str, Any]:
        """Run `attempt`; a verdict it reaches before its transaction is journaled too."""
        # A verdict journal.execute stored already is found and replayed as is.
        async with self.journal.refusals(operation=operation, params=params, body=body,
                                         identity_id=identity_id):
            result: dict[str, Any] = await attempt()
        return result

    async def place(self, demand: Demand, pinned: str | None, args: Args, commit: Commit,
                    journal: Callable[..., Any]) -> dict[str, Any]:
        return await self.placement.place(demand, pinned, args, commit, journal)

    # ------------------------------------------------------------------ stop, delete

    async def stop(self, workspace_id: str, body: WorkspaceStopIn,
                   identity_id: str | None) -> dict[str, Any]:
        self.runtime.require_running()
        async with self.lock(workspace_id):
            outcome = await self.journal.execute(
                operation="workspace.stop", params={"workspace_id": workspace_id}, body=body,
                identity_id=identity_id,
                fn=partial(tx.begin_stop, workspace_id=workspace_id, force=body.force,
                           expected=body.expected_version, now=self.ctx.now()))
            result = outcome.result
            if outcome.replayed and result.get("state") == w.STOPPING:
                again = await self.store.write(partial(
                    tx.continue_stop, workspace_id=workspace_id,
                    instance_id=result.get("instance_id"), force=body.force,
                    now=self.ctx.now()))
                result = result if again is None else again
        if result.get("state") == w.STOPPING:
            self.runtime.spawn(self.tasks.stop, workspace_id)
        return result

    async def delete(self, workspace_id: str, body: VersionedWrite,
                     identity_id: str | None) -> dict[str, Any]:
        self.runtime.require_running()
        async with self.lock(workspace_id):
            outcome = await self.journal.execute(
                operation="workspace.delete", params={"workspace_id": workspace_id},
                body=body, identity_id=identity_id,
                fn=partial(tx.begin_delete, workspace_id=workspace_id,
                           expected=body.expected_version, now=self.ctx.now()))
        if outcome.result.get("state") == w.DELETING:
            self.runtime.spawn(self.tasks.delete, workspace_id)
        return outcome.result

    # ------------------------------------------------------------------ reads

    async def get(self, workspace_id: str, wait_s: float = 0.0) -> dict[str, Any]:
        """The Workspace; with `wait_s`, once it is settled or that time has passed."""
        deadline = trio.current_time() + wait_s
        while True:
            changed = self._ws_changed
            result = await self.store.run(partial(_get_json, workspace_id=workspace_id))
            remaining = deadline - trio.current_time()
            if result["state"] in w.SETTLED or remaining <= 0:
                return result
            with trio.move_on_after(min(remaining, 1.0)):
                await changed.wait()

    # ------------------------------------------------------------------ SessionObserver

    async def session_started(self, node_id: str, hello: Hello) -> None:
        self._drain_known[node_id] = await self.store.run(partial(_drain_flag, node_id=node_id))
        await self.feed.session_started(node_id, hello)

    async def node_report(self, node_id: str, report: Report) -> None:
        await self.feed.node_report(node_id, report)

    async def instance_state(self, node_id: str, frame: InstanceState) -> None:
        await self.feed.instance_state(node_id, frame)

    async def session_ended(self, node_id: str) -> None:
        self.runtime.wake()


def _create_plan(session: Session, wanted: list[tuple[str, str]],
                 policy: dict[str, Any] | None) -> tuple[list[va.AttachPlan], netpol.Resolved]:
    """What a create checks before placing, in one transaction: its Volumes attachable
    and its network policy's Egress and Resolver found."""
    return va.attach_plans(session, wanted), netpol.resolve(session, policy)


def _get_json(session: Session, workspace_id: str) -> dict[str, Any]:
    ws = w.get_workspace(session, workspace_id)
    instance_id = ws.current_instance_id or ws.last_instance_id
    inst = session.get(Instance, instance_id) if instance_id else None
    return w.workspace_json(ws, inst)


def _drain_flag(session: Session, node_id: str) -> bool:
    node = session.get(Node, node_id)
    return bool(node is not None and node.drain_requested)

