"""`VmInstanceManager`: the node's Instances, their commands, states and holdings.

It answers the session commands of docs/architecture.md ("Session commands for
Instances"), each idempotent by its IDs: ``instance.create`` is admitted by the node
itself (refused while drained or while host memory is tight) and answered at once, the
boot going on in the background (`kibotos.node.instances.lifecycle`); ``instance.stop`` and
``instance.destroy`` return when the VMM is gone and what it held is released, and the
Instance has then ended (`kibotos.node.records.instance_dirs`: directory removed, log tails and
a registry entry kept, no longer listed); ``layer.delete`` removes a retained layer;
``node.drain`` sets the drain flag.  Every state change is persisted, published as an
``instance_state`` frame and signalled to the report.  A watcher looks at each running
VMM every ``monitor_interval``: one that ended on its own makes its Instance FAILED
with the spec's reason (``oom_killed`` when the supervisor saw an OOM kill); the
Instance keeps its resources and objects until stopped with force or destroyed.
Every 5 s `kibotos.node.storage.holder_watch` rereads the holder records of what the Instances
hold open and fences an Instance whose use right was taken over (FAILED, receipt).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from kibotos.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    KibotosError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kibotos.core.logs import EventLogger
from kibotos.node.host.vmstats import VmUsageMeter
from kibotos.node.instances import adoption, network_switch
from kibotos.node.instances.adoption_background import TAKEOVER_POOL_WAIT, Takeover
from kibotos.node.instances.cleanup import STUCK_ERRORS, PendingCleanups
from kibotos.node.instances.commands import (
    TransferTarget,
    command_handlers,
    transfer_handlers,
)
from kibotos.node.instances.contract import (
    DESTROYED,
    FAILED,
    RUNNING,
    STOPPED,
    STOPPING,
    CommandHandler,
    Holdings,
    InstanceSummary,
    ManagerGauges,
    StateFeed,
)
from kibotos.node.instances.lifecycle import Instance, Launcher, Settings
from kibotos.node.records import instance_records as records
from kibotos.node.records import machine_logs
from kibotos.node.records.instance_dirs import EXITED_REASON, OOM_REASON, OOM_RESULTS, InstanceDirs
from kibotos.node.records.registry import prune_loop, recording, registry_handlers
from kibotos.node.runtime import installations
from kibotos.node.storage.holder_watch import HolderWatch
from kibotos.node.storage.objects import RETAINED_LAYERS, VOLUMES
from kibotos.node.storage.volume_ops import NodeStorage
from kibotos.protocol import CreateSpec, GuestFacts, InstanceState, NetworkPolicy
from kibotos.protocol.values import clip

log = EventLogger()



class VmInstanceManager:
    """The real `kibotos.node.instances.contract.InstanceManager`; see the module docstring."""

    def __init__(self, *, node_id: str, root: Path, launcher: Launcher,
                 shared_pools: Mapping[str, bool], memory_tight: Callable[[], bool],
                 settings: Settings, machine_logs_limit: int = machine_logs.DEFAULT_LIMIT
                 ) -> None:
        self.node_id = node_id
        self.dirs = InstanceDirs(root, machine_logs_limit=machine_logs_limit)
        self.launcher = launcher
        self.shared_pools = dict(shared_pools)
        self.memory_tight = memory_tight
        self.settings = settings
        self.drain_requested = False
        self.probe_result: Mapping[str, Any] | None = None
        self.backend_error: str | None = None
        self._instances: dict[str, Instance] = {}
        self._retained: set[tuple[str, str, str]] = set()
        self._feed = StateFeed()
        self._changed: Callable[[], None] = lambda: None
        self._nursery: trio.Nursery | None = None
        self._probed = trio.Event()
        self._meter = VmUsageMeter()
        self._started_vm = False
        #: Adoption's background half (`kibotos.node.instances.adoption_background`);
        #: tests shorten its waits.
        self.takeover = Takeover(root=root, launcher=launcher, set_state=self._set_state,
                                 publish=self._publish, pool_wait=TAKEOVER_POOL_WAIT,
                                 facts_at_readiness=adoption.facts_at_readiness)
        #: volume.create/delete, object.expand/copy (`kibotos.node.storage.volume_ops`)
        self.storage = NodeStorage(node_id=node_id, pool=launcher.pool,
                                   instances=lambda: list(self._instances.values()),
                                   shared_pools=self.shared_pools, retained=self._retained,
                                   changed=lambda: self._changed())
        #: object.export/import (`kibotos.node.storage.transfer`); set by `vmsetup` when the
        #: node has a credential for ctrl's artifact store
        self.transfers: TransferTarget | None = None
        self.cleanups = PendingCleanups(launcher, finish=self._finish_release,
                                        publish=self._publish)
        #: The 5 s holder check (`kibotos.node.storage.holder_watch`), run by `run`.
        self.holder_watch = HolderWatch(launcher, instances=self.instances, fail=self.fail)
        #: What this start did with the Instances it found (adoption verdict → count;
        #: the node's ``/metrics``, docs/metrics.md).
        self.adoption_counts: dict[str, int] = {}

    # ------------------------------------------------------------------ the protocol

    def set_change_callback(self, callback: Callable[[], None]) -> None:
        self._changed = callback

    def state_feed(self) -> StateFeed:
        return self._feed

    def set_drain_requested(self, requested: bool) -> None:
        if requested != self.drain_requested:
            log.info("drain requested" if requested else "drain cancelled")
        self.drain_requested = requested

    def gauges(self) -> ManagerGauges:
        pending = sum(1 for i in self._instances if self.cleanups.get(i) is not None)
        return ManagerGauges(self.drain_requested, dict(self.adoption_counts), pending)

    def holdings(self) -> Holdings:
        cpu = memory = count = 0
        objects = set(self._retained)
        for inst in self._instances.values():
            if inst.holding:
                cpu += inst.spec.cpu_millis
                memory += inst.spec.memory_bytes
                count += 1
            if not inst.released:
                objects.update((h.pool_id, h.kind, h.object_id) for h in inst.held)
        summaries = tuple(InstanceSummary(i.instance_id, i.spec.workspace_id, i.state,
                                          i.reason, tuple(i.objects_wire()))
                          for i in sorted(self._instances.values(),
                                          key=lambda i: i.instance_id))
        return Holdings(cpu, memory, count, len(objects), summaries)

    def vm_usage(self) -> tuple[float | None, int | None]:
        processes = [i.main_process for i in self._instances.values()
                     if i.holding and i.main_process is not None]
        if not self._started_vm and not processes:
            return None, None
        return self._meter.measure(processes)

    def command_handlers(self) -> Mapping[str, CommandHandler]:
        extra = transfer_handlers(self.transfers) if self.transfers is not None else {}
        return recording({**command_handlers(self), **registry_handlers(self.dirs.records),
                          **extra}, self.dirs.records)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.launcher.network is not None:  # before adoption reads the tables
                    await self.launcher.network.prepare_host()
                await self._restore()
                nursery.start_soon(self._probe)
                nursery.start_soon(self._watch)
                nursery.start_soon(self.holder_watch.run)
                nursery.start_soon(prune_loop, self.dirs.records)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await self.launcher.templates.aclose()

    async def destroy_all(self) -> int:
        ids = list(self._instances)
        for instance_id in ids:
            try:
                await self.destroy(instance_id)
            except KibotosError as exc:
                log.error("instance destroy failed", instance=instance_id, error=exc.message)
        return len(ids)

    # ------------------------------------------------------------------ commands

    # ------------------------------------------------------------------ create

    async def create(self, spec: CreateSpec) -> dict[str, Any]:
        """Admit, record, and boot in the background; ``{accepted: true}`` at once."""
        existing = self._instances.get(spec.instance_id)
        if existing is not None:
            if existing.spec.digest() == spec.digest():
                return {"accepted": True}
            raise AlreadyExists(f"Instance {spec.instance_id} already exists on node "
                                f"{self.node_id} with other arguments")
        if self.dirs.ended(spec.instance_id) is not None:
            raise FailedPrecondition(f"Instance {spec.instance_id} was destroyed on node "
                                     f"{self.node_id}; a new start needs a new Instance ID")
        self._admit(spec)
        inst = Instance(spec=spec, dir=self.dirs.dir_for(spec.instance_id))
        self._instances[spec.instance_id] = inst  # before any await: a replay finds it
        try:
            await trio.to_thread.run_sync(self.dirs.make, inst)
        except BaseException:
            del self._instances[spec.instance_id]
            raise
        log.info("instance accepted", instance=spec.instance_id,
                 workspace=spec.workspace_id, cpu_millis=spec.cpu_millis,
                 memory_bytes=spec.memory_bytes)
        self._publish(inst)
        assert self._nursery is not None, "run() must be started before commands arrive"
        self._nursery.start_soon(self._boot, inst)
        return {"accepted": True}

    def _admit(self, spec: CreateSpec) -> None:
        """The node's own admission, before anything is written."""
        if self.drain_requested:
            raise FailedPrecondition(f"node {self.node_id} is drained: it takes no new "
                                     "Instances", details={"reason": "drained"})
        if self.memory_tight():
            raise ResourceExhausted(f"host memory is tight on node {self.node_id}: it takes "
                                    "no new Instances", details={"reason": "memory_tight"})
        if self.backend_error is not None:
            raise FailedPrecondition(f"node {self.node_id} cannot run VMs: "
                                     f"{self.backend_error}", details={"reason": "vmm_unusable"})
        if spec.network is not None:
            network_switch.admit(self.launcher, spec)
        self.launcher.pool(spec.layer.pool_id, RETAINED_LAYERS)
        self.storage.check_idle((RETAINED_LAYERS, spec.layer.pool_id, spec.layer.ref))
        for vol in spec.volumes:
            self.launcher.pool(vol.pool_id, VOLUMES)
            self.storage.check_idle((VOLUMES, vol.pool_id, vol.volume_id))
        for other in self._instances.values():
            if other.holding and other.spec.layer.pool_id == spec.layer.pool_id and \
                    other.spec.layer.ref == spec.layer.ref:
                raise FailedPrecondition(
                    f"retained layer {spec.layer.ref} of pool {spec.layer.pool_id} is in use "
                    f"by Instance {other.instance_id} ({other.state})")

    async def _boot(self, inst: Instance) -> None:
        async with inst.lock:
            with trio.CancelScope() as scope:
                inst.boot_scope = scope
                try:
                    await self._boot_steps(inst)
                except (KibotosError, OSError) as exc:
                    reason = exc.message if isinstance(exc, KibotosError) else str(exc)
                    log.error("instance boot failed", instance=inst.instance_id, error=reason)
                    await self._set_state(inst, FAILED, reason)
                except Exception as exc:  # a bug must not end the node with its VMs
                    log.error("instance boot failed unexpectedly", instance=inst.instance_id,
                              error=repr(exc))
                    await self._set_state(inst, FAILED, f"internal: {exc!r}")
                finally:
                    inst.boot_scope = None
                    inst.boot_done.set()

    async def _boot_steps(self, inst: Instance) -> None:
        await self._probed.wait()
        if self.backend_error is not None:
            raise FailedPrecondition(f"node {self.node_id} cannot run VMs: {self.backend_error}")
        steps = _StepClock()
        layer, volumes = await self.launcher.open_objects(inst)
        await self._persist(inst)  # `held` on disk before any VMM can have them open
        self._changed()
        steps.mark("objects")
        network = await self.launcher.setup_network(inst)
        if network is not None:
            steps.mark("network")
        launch = await self.launcher.launch_description(inst, layer, volumes, network)
        steps.mark("template")
        try:
            try:
                await self.launcher.start_unit(inst, launch)
            finally:
                await self._persist(inst)
            steps.mark("unit")
            self._started_vm = True
            guest = await self.launcher.wait_ready(inst, launch)
            steps.mark("ready")
            await self.launcher.configure_guest(inst)
            steps.mark("configure")
        except (KibotosError, OSError):
            if inst.unit_name is not None:  # the unit may run: a failed boot leaves none
                with trio.CancelScope(shield=True):
                    try:
                        await self.launcher.stop_unit(inst)
                    except (KibotosError, OSError) as exc:
                        log.error("instance boot failed and its unit did not stop",
                                  instance=inst.instance_id, error=str(exc))
            raise
        record = await adoption.facts_at_readiness(inst, self.launcher.supervisor)
        await trio.to_thread.run_sync(records.add_guest, inst.dir, record, guest)
        inst.guest = {"boot_id": guest.get("boot_id"),
                      "capabilities": sorted(guest.get("capabilities") or [])}
        steps.mark("record")
        log.info("instance running", instance=inst.instance_id, unit=inst.unit_name,
                 boot_id=inst.guest["boot_id"], seconds=steps.text())
        await self._set_state(inst, RUNNING)

    # ------------------------------------------------------------------ stop, destroy

    async def stop(self, instance_id: str, *, force: bool, deadline_s: float
                   ) -> dict[str, Any]:
        inst = self._instances.get(instance_id)
        if inst is None:
            ended = self.dirs.ended(instance_id)
            if ended is not None:
                return {"confirmed_on_disk": bool(ended.get("confirmed_on_disk"))}
            raise NotFound(f"Instance {instance_id} is not on node {self.node_id}")
        if (pending := self.cleanups.get(instance_id)) is not None:
            return await self.cleanups.wait(pending, STOPPED)
        if force and inst.boot_scope is not None:
            inst.boot_scope.cancel()
        async with inst.lock:
            if inst.state in (STOPPED, DESTROYED):  # a concurrent stop or destroy ended it
                return {"confirmed_on_disk": bool(inst.confirmed_on_disk)}
            if instance_id in self.takeover.not_taken_over:  # left running, not adopted
                await adoption.check_ownership(inst, self.launcher.supervisor)
            await self._set_state(inst, STOPPING)
            try:
                active = await self.launcher.unit_active(inst)
                if force:
                    if active:
                        await self.launcher.short_sync(inst)
                    confirmed = False
                elif active:
                    await self.launcher.prepare_stop(inst, deadline_s)
                    confirmed = True
                else:
                    confirmed = False  # the VMM already ended: nothing could be flushed
                await self._release(inst, STOPPED, confirmed)
            except Unavailable:  # cleanup pending: stays STOPPING, retried in the background
                raise
            except (KibotosError, OSError) as exc:
                reason = exc.message if isinstance(exc, KibotosError) else str(exc)
                log.error("instance stop failed", instance=instance_id, error=reason)
                await self._set_state(inst, FAILED, reason)
                raise
            self._after_release(inst)
            inst.confirmed_on_disk = confirmed
            log.info("instance stopped", instance=instance_id, force=force,
                     confirmed_on_disk=confirmed)
            await self._end(inst, STOPPED)
            return {"confirmed_on_disk": confirmed}

    async def destroy(self, instance_id: str) -> dict[str, Any]:
        inst = self._instances.get(instance_id)
        if inst is None:
            return {"destroyed": True}
        if (pending := self.cleanups.get(instance_id)) is not None:
            return await self.cleanups.wait(pending, DESTROYED)
        if inst.boot_scope is not None:
            inst.boot_scope.cancel()
        async with inst.lock:
            if self._instances.get(instance_id) is not inst:
                return {"destroyed": True}  # a concurrent destroy finished it
            if instance_id in self.takeover.not_taken_over:  # left running, not adopted
                await adoption.check_ownership(inst, self.launcher.supervisor)
            await self._release(inst, DESTROYED, False)
            self._after_release(inst)
            log.info("instance destroyed", instance=instance_id)
            await self._end(inst, DESTROYED)
            return {"destroyed": True}

    async def _release(self, inst: Instance, final: str, confirmed: bool) -> None:
        """Stop the unit, then release the objects.  Processes left behind make the
        release pending (`kibotos.node.instances.cleanup`): STOPPING, retried in the background
        until it reaches `final`; the command answers ``unavailable``."""
        try:
            await self.launcher.stop_unit(inst)
            await self.launcher.release_objects(inst, confirmed_on_disk=confirmed)
            await self.launcher.release_network(inst)
        except STUCK_ERRORS as exc:
            if inst.state != STOPPING:
                inst.state, inst.reason = STOPPING, None
                await self._persist(inst)
            assert self._nursery is not None
            raise self.cleanups.begin(self._nursery, inst, final=final,
                                      confirmed=confirmed, error=exc) from None

    async def _finish_release(self, inst: Instance, final: str, confirmed: bool) -> None:
        """A pending release finished: the Instance ends as the command asked."""
        self._after_release(inst)
        inst.confirmed_on_disk = confirmed
        log.info("instance stopped" if final == STOPPED else "instance destroyed",
                 instance=inst.instance_id, confirmed_on_disk=confirmed, after_pending=True)
        await self._end(inst, final)

    async def _end(self, inst: Instance, state: str) -> None:
        """The Instance ended (stopped or destroyed; a new start is a new Instance):
        its unit is gone and its objects released, so its directory goes, leaving the
        log tails and a registry entry, and the node no longer lists it."""
        inst.state, inst.reason = state, None
        await self._persist(inst)
        await trio.to_thread.run_sync(self.dirs.remove, inst)
        if self._instances.get(inst.instance_id) is inst:
            del self._instances[inst.instance_id]
        await self.launcher.templates.release(inst.instance_id)
        self._publish(inst)

    def _after_release(self, inst: Instance) -> None:
        """Objects of a private pool stay this node's after a release (ctrl keeps the
        holder); in a shared pool the use right goes back to ctrl."""
        for h in inst.held:
            if not self.shared_pools.get(h.pool_id, False):
                self._retained.add((h.pool_id, h.kind, h.object_id))

    async def set_network(self, instance_id: str, network: NetworkPolicy, revision: int
                          ) -> dict[str, Any]:
        """``instance.set_network`` (`kibotos.node.instances.network_switch`)."""
        inst = self._instances.get(instance_id)
        if inst is None:
            raise NotFound(f"Instance {instance_id} is not on node {self.node_id}")
        return await network_switch.switch(self.launcher, inst, network, revision)

    async def delete_layer(self, pool_id: str, ref: str, epoch: int) -> dict[str, Any]:
        pool = self.launcher.pool(pool_id, RETAINED_LAYERS)
        self.storage.check_idle((RETAINED_LAYERS, pool_id, ref))  # not while it grows
        for inst in self._instances.values():
            if not inst.released and any(h.kind == RETAINED_LAYERS and h.pool_id == pool_id
                                         and h.object_id == ref for h in inst.held):
                raise FailedPrecondition(f"retained layer {ref} of pool {pool_id} is in use "
                                         f"by Instance {inst.instance_id} ({inst.state})")
        existed = await trio.to_thread.run_sync(pool.delete, ref, epoch)
        self._retained.discard((pool_id, RETAINED_LAYERS, ref))
        log.info("retained layer deleted", pool=pool_id, ref=ref, epoch=epoch, existed=existed)
        self._changed()
        return {"deleted": True}

    # ------------------------------------------------------------------ state

    async def _persist(self, inst: Instance) -> None:
        await self.dirs.persist(inst)

    async def _set_state(self, inst: Instance, state: str, reason: str | None = None) -> None:
        inst.state, inst.reason = state, reason
        await self._persist(inst)
        self._publish(inst)

    def _publish(self, inst: Instance, extra: dict[str, Any] | None = None) -> None:
        """Publish the Instance's ``instance_state`` frame (built as the protocol's
        `InstanceState`, so a field the node gets wrong fails here, not at ctrl);
        `extra` adds fields (a stuck release's ``cleanup``)."""
        frame: dict[str, Any] = {"type": "instance_state", "instance_id": inst.instance_id,
                                 "workspace_id": inst.spec.workspace_id, "state": inst.state,
                                 "reason": clip(inst.reason), "at": records.now_iso(),
                                 "objects": inst.objects_wire(), **(extra or {})}
        if inst.state == RUNNING and inst.guest is not None:
            frame["guest"] = GuestFacts.from_guest(inst.guest).to_wire()
        self._feed.publish(InstanceState.model_validate(frame).to_wire())
        self._changed()

    # ------------------------------------------------------------------ background

    async def _probe(self) -> None:
        try:
            self.probe_result = await self.launcher.backend.probe()
            log.info("vmm backend ready", backend=self.launcher.backend.name,
                     accelerator=self.probe_result.get("accelerator"))
            for warning in self.probe_result.get("warnings") or ():
                log.warning("vmm backend warning", backend=self.launcher.backend.name,
                            warning=str(warning))
        except Exception as exc:
            self.backend_error = exc.message if isinstance(exc, KibotosError) else repr(exc)
            log.error("vmm backend unusable: creates are refused",
                      backend=self.launcher.backend.name, error=self.backend_error)
        finally:
            self._probed.set()

    async def _watch(self) -> None:
        """Notice VMMs that ended on their own."""
        while True:
            await trio.sleep(self.settings.monitor_interval)
            for inst in list(self._instances.values()):
                if inst.state != RUNNING or inst.lock.locked() or inst.unit_name is None:
                    continue
                try:
                    info = await self.launcher.supervisor.describe(inst.unit_name)
                except KibotosError as exc:
                    log.warning("cannot look at a VMM unit", unit=inst.unit_name,
                                error=exc.message)
                    continue
                main = inst.main_process
                if info is not None and info.active and \
                        (main is None or info.main_pid == main[0]):
                    continue
                if inst.state != RUNNING or inst.lock.locked():
                    continue  # a stop or destroy began meanwhile: the exit is theirs
                reason = OOM_REASON if info is not None and info.result in OOM_RESULTS \
                    else EXITED_REASON
                log.error("instance VMM exited unexpectedly", instance=inst.instance_id,
                          unit=inst.unit_name, result=info.result if info else None,
                          reason=reason)
                async with inst.lock:
                    if inst.state == RUNNING:
                        await self._set_state(inst, FAILED, reason)

    async def _restore(self) -> None:
        """What a previous node process left: the objects this node holds in its
        private pools, and its Instances, adopted (`kibotos.node.instances.adoption`: a record
        that does not match the running units refuses the start)."""
        for pool_id, shared in self.shared_pools.items():
            for kind in () if shared else (RETAINED_LAYERS, VOLUMES):
                objects = self.launcher.pool(pool_id, kind)
                held = await trio.to_thread.run_sync(objects.held_by_me)
                self._retained.update((pool_id, kind, ref) for ref in held)
        loaded = await trio.to_thread.run_sync(self.dirs.read_all)
        verdicts, leftovers = await adoption.examine(loaded, self.launcher.supervisor,
                                                     self.dirs.instances)
        for verdict in verdicts:
            self._instances[verdict.inst.instance_id] = verdict.inst
            self.adoption_counts[verdict.action] = self.adoption_counts.get(verdict.action, 0) + 1
        assert self._nursery is not None
        if await adoption.carry_out(verdicts, leftovers, supervisor=self.launcher.supervisor,
                                    takeover=self.takeover, nursery=self._nursery,
                                    set_state=self._set_state, publish=self._publish,
                                    boot=self._boot):
            self._started_vm = True
        # after the takeover: installations of failed adoptions are still recorded
        pinned = self.launcher.installation or {}
        await trio.to_thread.run_sync(installations.prune, self.dirs.machine_logs.parent,
                                      [pinned.get("identity", "")])

    def get(self, instance_id: str) -> Instance | None:
        """The Instance as the node sees it (tests and tools)."""
        return self._instances.get(instance_id)

    def instances(self) -> list[Instance]:
        """The Instances the node has now (the holder check walks them)."""
        return list(self._instances.values())

    async def fail(self, inst: Instance, reason: str) -> None:
        """Make `inst` FAILED with `reason`, persisted and published (the holder
        check, which holds ``inst.lock``)."""
        await self._set_state(inst, FAILED, reason)


class _StepClock:
    """Seconds spent in each step of a boot, for the ``instance running`` record: where
    create → ready goes on the host (objects, Template links, unit start, the guest's
    hello, its configuration, the launch record), as bench/boot.py reports it."""

    def __init__(self) -> None:
        self._last = time.monotonic()
        self._steps: list[tuple[str, float]] = []

    def mark(self, step: str) -> None:
        now = time.monotonic()
        self._steps.append((step, now - self._last))
        self._last = now

    def text(self) -> str:
        return ",".join(f"{name}:{spent:.3f}" for name, spent in self._steps)
