"""One Instance's life on this node: launch, readiness, stop, and what it holds.

`Instance` is the node's in-memory view (persisted in ``instance.json`` on every
change); `Launcher` does the work with the VMM backend, the supervisor, the pool
objects and the guest agent.  The order of a launch is the spec's
(node-and-vmm-processes, "Launch records and adoption"):

1. write this node's attachment records (`kibotos.node.records.attachments`), then open the
   writable layer (create it on the first start) and the Volumes, each after the
   takeover check of its holder record (`kibotos.node.storage.objects`);
2. with a network (``CreateSpec.network``), make the Instance's namespace, veth, tap,
   addresses, routes and slot table (`kibotos.node.instances.network_step`); then find
   the Template's blobs and link them into the Instance directory;
3. build the unit (`VmmBackend.unit_for`) and write the launch record ``systemd.json``
   *before* the unit starts;
4. start the unit through the supervisor, then add its InvocationID, MainPID, start
   time, executable, cgroup and namespace to the record;
5. wait for the guest's hello through the backend, within ``ready_timeout``, while
   watching that the unit still runs (a VMM that died is not waited for); on failure
   stop the unit;
6. hand the guest its launch configuration, record the accepted guest (boot ID,
   capabilities); then the Instance is RUNNING.

Stops: a normal stop asks the guest to end its processes, sync and freeze
(``stop_prepare``); if that fails the VMM is left running and the error starts with
``prepare guest stop:`` (spec troubleshooting).  ``force`` asks for a short sync if the
guest answers and stops the VMM regardless.  Either way the unit is stopped, the node
confirms none of its processes remains, and only then releases the objects (each
object's attachment record goes after its release is recorded) and removes the
network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from kibotos.backends import Supervisor, UnitInfo, VmmBackend
from kibotos.core import failpoints, ids
from kibotos.core.errors import FailedPrecondition, KibotosError, Unavailable
from kibotos.core.logs import EventLogger
from kibotos.guest import (
    Dns,
    GuestChannel,
    LaunchConfig,
    open_guest_channel,
)
from kibotos.node.host.vmstats import read_process
from kibotos.node.instances.contract import CREATING, HOLDING_STATES
from kibotos.node.instances.network_step import NetworkStep
from kibotos.node.records import instance_records as records
from kibotos.node.records.attachments import Attachments
from kibotos.node.runtime.build_identity import BuildIdentity
from kibotos.node.runtime.build_identity import current as current_build
from kibotos.node.runtime.guest_volumes import guest_volumes
from kibotos.node.storage.objects import RETAINED_LAYERS, VOLUMES, PoolObjects
from kibotos.node.storage.templates import TemplateSource, link_into
from kibotos.protocol import CreateSpec
from kibotos.vmm_ready import first_kibotos_error

log = EventLogger()

#: How often a booting VMM is checked while its guest is awaited.
_BOOT_WATCH = 0.5
_GUEST_CONNECT = 10.0
_LOG_TAIL = 64 * 1024
PROC = Path("/proc")


@dataclass(frozen=True)
class Settings:
    """The node's timing around VMs; from ``[vmm]``, shortened by tests."""

    ready_timeout: float = 300.0
    stop_timeout: float = 30.0
    force_sync_timeout: float = 5.0
    monitor_interval: float = 1.0


@dataclass(frozen=True)
class HeldObject:
    """An object an Instance opened.  `released_cleanly` is how it came to this node:
    True after a clean release or a receipt, False when the receipt wait ended without
    one (spec: storage-pools-on-nfs, "Epochs and takeover"), None when it was no
    handoff (a new object, a retry, an adoption).  It is not part of the identity."""

    kind: str
    pool_id: str
    object_id: str
    epoch: int
    released_cleanly: bool | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "pool_id": self.pool_id, "object_id": self.object_id,
                "epoch": self.epoch, "released_cleanly": self.released_cleanly}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> HeldObject:
        clean = value.get("released_cleanly")  # absent in records of older nodes
        return cls(str(value["kind"]), str(value["pool_id"]), str(value["object_id"]),
                   int(value["epoch"]), clean if isinstance(clean, bool) else None)


@dataclass(eq=False)
class Instance:
    spec: CreateSpec
    dir: Path
    state: str = CREATING
    reason: str | None = None
    guest: dict[str, Any] | None = None
    unit_name: str | None = None
    launch: dict[str, Any] | None = None
    main_process: tuple[int, int] | None = None
    held: list[HeldObject] = field(default_factory=list)
    released: bool = False
    confirmed_on_disk: bool | None = None
    created_at: str = field(default_factory=records.now_iso)
    lock: trio.Lock = field(default_factory=trio.Lock)
    boot_scope: trio.CancelScope | None = None
    boot_done: trio.Event = field(default_factory=trio.Event)

    @property
    def instance_id(self) -> str:
        return self.spec.instance_id

    @property
    def holding(self) -> bool:
        return self.state in HOLDING_STATES

    def objects_wire(self) -> list[dict[str, Any]]:
        """``objects`` of its ``instance_state`` frames and ``hello``/``report`` entries:
        what it opened and how each handoff went (docs/architecture.md)."""
        return [h.to_json() for h in self.held]

    def to_record(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "workspace_id": self.spec.workspace_id,
            "spec": self.spec.model_dump(mode="json"),
            "state": self.state,
            "reason": self.reason,
            "guest": self.guest,
            "unit_name": self.unit_name,
            "launch": self.launch,
            "main_process": list(self.main_process) if self.main_process else None,
            "held": [h.to_json() for h in self.held],
            "released": self.released,
            "confirmed_on_disk": self.confirmed_on_disk,
            "created_at": self.created_at,
        }

    @classmethod
    def from_record(cls, instance_dir: Path, rec: Mapping[str, Any]) -> Instance:
        spec = CreateSpec.model_validate(rec["spec"])
        main = rec.get("main_process")
        inst = cls(spec=spec, dir=instance_dir, state=str(rec["state"]),
                   reason=rec.get("reason"), guest=rec.get("guest"),
                   unit_name=rec.get("unit_name"), launch=rec.get("launch"),
                   main_process=(int(main[0]), int(main[1])) if main else None,
                   held=[HeldObject.from_json(h) for h in rec.get("held") or []],
                   released=bool(rec.get("released")),
                   confirmed_on_disk=rec.get("confirmed_on_disk"),
                   created_at=str(rec.get("created_at") or records.now_iso()))
        inst.boot_done.set()
        return inst


def unit_name_for(instance_id: str) -> str:
    return f"kibotos-vmm-{ids.check_object_id(instance_id, 'instance ID')}.service"


class Launcher:
    """Launches and stops the VMs of one node."""

    def __init__(self, *, node_id: str, backend: VmmBackend, supervisor: Supervisor,
                 pools: Mapping[tuple[str, str], PoolObjects], templates: TemplateSource,
                 settings: Settings, attachments: Attachments) -> None:
        self.node_id = node_id
        #: This node's attachment records (``runtime/storage-pools/``): written before
        #: an object is opened for an Instance, removed after its release is recorded.
        self.attachments = attachments
        self.backend = backend
        self.supervisor = supervisor
        self.pools = pools
        self.templates = templates
        self.settings = settings
        #: The runtime installation new launches pin (``kibotos.node.runtime.installations``;
        #: set by the node at start): ``{identity, runtime_version}``.
        self.installation: dict[str, Any] | None = None
        #: The build whose rules decide upgrades (`kibotos.node.runtime.build_identity`).
        self.build: BuildIdentity = current_build()
        #: The Instances' network (``[network]``); None: this node gives none.
        self.network: NetworkStep | None = None

    def pool(self, pool_id: str, kind: str) -> PoolObjects:
        try:
            return self.pools[(pool_id, kind)]
        except KeyError:
            raise FailedPrecondition(f"storage pool {pool_id} is not configured on node "
                                     f"{self.node_id}") from None

    # ------------------------------------------------------------------ launch

    async def open_objects(self, inst: Instance) -> tuple[Path, list[Path]]:
        """The writable layer (made on the first start) and the Volumes, opened at the
        command's epochs; recorded in `inst.held` as each is opened.  The attachment
        records (`kibotos.node.records.attachments`) are written first; then all holder
        records, then the previous holders' receipts are awaited together under one
        deadline (spec: at most 15 s when a Workspace takes over a Volume and its
        layer), then each is opened.  A failure removes the attachment records of the
        objects it did not open."""
        spec = inst.spec
        layer = spec.layer
        lower = {"template": spec.template.name, "image_digest": spec.template.image_digest}
        layers = self.pool(layer.pool_id, RETAINED_LAYERS)
        wanted = [(HeldObject(RETAINED_LAYERS, layer.pool_id, layer.ref, layer.epoch),
                   layer.capacity_bytes if layer.create else None)]
        wanted += [(HeldObject(VOLUMES, v.pool_id, v.volume_id, v.epoch), None)
                   for v in spec.volumes]
        for obj, _ in wanted:
            self.pool(obj.pool_id, obj.kind)  # an unknown pool: refused before any write
        await self.record_attachments(inst, [o for o, _ in wanted])
        failpoints.hit("node.instance.after-attachment-record")
        try:
            paths = await self._open_wanted(inst, wanted, layers.receipt_wait, lower)
        except BaseException:
            with trio.CancelScope(shield=True):  # records of what was not opened go
                await trio.to_thread.run_sync(self._drop_unopened, inst,
                                              [o for o, _ in wanted])
            raise
        failpoints.hit("node.instance.after-objects-open")
        return paths[0], paths[1:]

    async def _open_wanted(self, inst: Instance, wanted: list[tuple[HeldObject, int | None]],
                           receipt_wait: float, lower: dict[str, str]) -> list[Path]:
        previous = [await self.pool(o.pool_id, o.kind).take(o.object_id, o.epoch,
                                                            may_create=cap is not None)
                    for o, cap in wanted]
        deadline = trio.current_time() + receipt_wait
        clean: list[bool | None] = [None] * len(wanted)

        async def wait(i: int, obj: HeldObject) -> None:
            clean[i] = await self.pool(obj.pool_id, obj.kind).wait_released(
                obj.object_id, previous[i], deadline)

        async with trio.open_nursery() as nursery:
            for i, (obj, _) in enumerate(wanted):
                nursery.start_soon(wait, i, obj)
        paths = []
        for i, (obj, cap) in enumerate(wanted):
            opened = await self.pool(obj.pool_id, obj.kind).finish_open(
                obj.object_id, obj.epoch, clean[i], create_capacity=cap,
                lower=lower if obj.kind == RETAINED_LAYERS else None)
            self._hold(inst, dataclasses.replace(obj, released_cleanly=opened.handoff_clean))
            paths.append(opened.path)
        return paths

    async def record_attachments(self, inst: Instance, objs: Sequence[HeldObject]) -> None:
        """The attachment records of `objs` for `inst`, before any of them is opened."""
        def write() -> None:
            for obj in objs:
                self.attachments.record(obj.pool_id, obj.kind, obj.object_id,
                                        instance_id=inst.instance_id, epoch=obj.epoch)
        await trio.to_thread.run_sync(write)

    def _drop_unopened(self, inst: Instance, objs: Sequence[HeldObject]) -> None:
        """An open failed: the records of the objects `inst` did not open go (those it
        holds from an earlier open stay).  Blocking."""
        for obj in objs:
            if obj not in inst.held:
                try:
                    self.attachments.remove(obj.pool_id, obj.kind, obj.object_id,
                                            instance_id=inst.instance_id)
                except OSError as exc:  # the next start deletes it (not held)
                    log.warning("attachment record not removed", instance=inst.instance_id,
                                pool=obj.pool_id, object=obj.object_id, error=str(exc))

    async def drop_attachment(self, inst: Instance, obj: HeldObject) -> None:
        """`obj`'s release or fence is recorded: its attachment record goes."""
        failpoints.hit("node.instance.before-attachment-removal")
        await trio.to_thread.run_sync(functools.partial(
            self.attachments.remove, obj.pool_id, obj.kind, obj.object_id,
            instance_id=inst.instance_id))

    def instance_objects(self, inst: Instance) -> list[HeldObject]:
        """What `inst` holds or opens: its held objects, then its spec's others."""
        spec = inst.spec
        out = list(inst.held)
        for obj in [HeldObject(RETAINED_LAYERS, spec.layer.pool_id, spec.layer.ref,
                               spec.layer.epoch)] + \
                [HeldObject(VOLUMES, v.pool_id, v.volume_id, v.epoch) for v in spec.volumes]:
            if obj not in out:
                out.append(obj)
        return out

    @staticmethod
    def _hold(inst: Instance, obj: HeldObject) -> None:
        """Add `obj`; a retry's open (no handoff) keeps what the first open found."""
        if obj not in inst.held:
            inst.held.append(obj)
        elif obj.released_cleanly is not None:
            inst.held[inst.held.index(obj)] = obj
        inst.released = False

    def network_step(self, inst: Instance) -> NetworkStep | None:
        """The network step when `inst` has a network (None when it has none); an
        Instance with a network on a node without ``[network]`` is an error."""
        if inst.spec.network is None:
            return None
        if self.network is None:
            raise FailedPrecondition(f"Instance {inst.instance_id} has a network and node "
                                     f"{self.node_id} has no [network]",
                                     details={"reason": "no_network"})
        return self.network

    async def setup_network(self, inst: Instance) -> dict[str, Any] | None:
        """The Instance's network made (before its VMM starts); ``launch["network"]``."""
        step = self.network_step(inst)
        if step is None:
            return None
        assert inst.spec.network is not None
        record = await step.setup(inst.instance_id, inst.spec.network,
                                  inst.spec.network_revision)
        failpoints.hit("node.instance.after-network")
        return step.launch_fields(record)

    async def release_network(self, inst: Instance) -> None:
        """Every network object of the Instance removed, after its VMM's cgroup is
        empty (`stop_unit`), and then its network record."""
        step = self.network_step(inst)
        if step is None:
            return
        failpoints.hit("node.instance.before-network-teardown")
        removed = await step.teardown(inst.instance_id)
        if removed:
            log.info("instance network removed", instance=inst.instance_id,
                     removed=", ".join(removed))

    async def launch_description(self, inst: Instance, layer: Path, volumes: Sequence[Path],
                                 network: Mapping[str, Any] | None = None
                                 ) -> dict[str, Any]:
        resolved = await self.templates.resolve(inst.spec.template, holder=inst.instance_id)
        platform, image = await trio.to_thread.run_sync(link_into, inst.dir, resolved)
        extra = {"network": dict(network)} if network is not None else {}
        return {
            "instance_id": inst.instance_id,
            "unit_name": unit_name_for(inst.instance_id),
            "runtime_dir": str(inst.dir),
            "platform_dir": str(platform),
            "template_image": str(image),
            "writable_layer": str(layer),
            "volumes": [{"path": str(p)} for p in volumes],
            "vcpus": max(1, -(-inst.spec.cpu_millis // 1000)),
            "memory": inst.spec.memory_bytes,
            **extra,
        }

    async def start_unit(self, inst: Instance, launch: dict[str, Any]) -> UnitInfo:
        """Launch record, then the unit, then the unit's facts in the record."""
        unit = self.backend.unit_for(launch)
        inst.unit_name = unit.name
        inst.launch = launch
        step = self.network_step(inst)

        def write() -> dict[str, Any]:
            net = None
            if step is not None and (found := step.records.read(inst.instance_id)):
                net = step.record_fields(found)
            return records.write_launch_record(
                inst.dir, launch_id=ids.new_id("lch"), instance_id=inst.instance_id,
                unit_name=unit.name, argv=unit.argv, supervisor=self.supervisor.name,
                backend=self.backend.name, launch=launch, installation=self.installation,
                network=net)

        record = await trio.to_thread.run_sync(write)
        failpoints.hit("node.instance.after-launch-record")
        info = await self.supervisor.start(unit)
        failpoints.hit("node.instance.after-unit-start")
        if info.main_pid is not None and info.start_time_ticks is not None:
            inst.main_process = (info.main_pid, info.start_time_ticks)
        await trio.to_thread.run_sync(records.add_unit_facts, inst.dir, record, info)
        return info

    async def wait_ready(self, inst: Instance, launch: dict[str, Any]) -> dict[str, Any]:
        """The guest's hello within ``ready_timeout``; fails at once if the unit ends."""
        assert inst.unit_name is not None
        result: dict[str, Any] = {}
        gone: str | None = None

        async def ready(cancel: trio.CancelScope) -> None:
            result.update(await self.backend.wait_ready(launch,
                                                        timeout=self.settings.ready_timeout))
            cancel.cancel()

        async def watch(cancel: trio.CancelScope) -> None:
            nonlocal gone
            while True:
                await trio.sleep(_BOOT_WATCH)
                info = await self.supervisor.describe(inst.unit_name or "")
                if info is None or not info.active:
                    gone = info.result if info is not None and info.result else "gone"
                    cancel.cancel()
                    return

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ready, nursery.cancel_scope)
                nursery.start_soon(watch, nursery.cancel_scope)
        except BaseExceptionGroup as group:
            found = first_kibotos_error(group)
            if found is None:
                raise
            raise found from None
        if gone is not None:
            tail = log_tail(inst.dir / "vmm.log", 400)
            raise FailedPrecondition(
                f"the VMM unit {inst.unit_name} ended ({gone}) before the guest was ready"
                + (f"; vmm.log ends with: {tail}" if tail else ""))
        failpoints.hit("node.instance.after-ready")
        return result

    def retained_filesystems(self) -> tuple[str, ...]:
        return tuple(self.backend.GUEST_RETAINED_FILESYSTEMS)

    @contextlib.asynccontextmanager
    async def guest(self, inst: Instance, timeout: float = _GUEST_CONNECT
                    ) -> AsyncIterator[GuestChannel]:
        """A session with the Instance's guest agent, its hello already received."""
        if inst.launch is None:
            raise Unavailable(f"Instance {inst.instance_id} has no launched VMM")
        deadline = trio.current_time() + timeout
        stream = await self.backend.guest_channel(inst.launch, timeout=timeout)
        try:
            async with open_guest_channel(stream) as channel:
                await channel.wait_hello(deadline)
                yield channel
        except BaseExceptionGroup as group:  # the channel's nursery wraps what we raise
            found = first_kibotos_error(group)
            if found is None:
                raise
            raise found from None

    def launch_config(self, inst: Instance) -> LaunchConfig:
        """What the guest is configured with: at boot, and again after a node restart
        (`kibotos.node.instances.adoption_background`)."""
        launch = inst.spec.launch
        step = self.network_step(inst)
        network = step.guest_network(inst.instance_id) if step is not None else None
        return LaunchConfig(hostname=launch.hostname, env=dict(launch.env),
                            volumes=guest_volumes(self.backend, inst.launch, inst.spec),
                            retained_filesystems=list(self.retained_filesystems()),
                            network=network[0] if network else None,
                            dns=Dns(nameservers=network[1]) if network else None)

    async def configure_guest(self, inst: Instance) -> None:
        config = self.launch_config(inst)
        async with self.guest(inst) as channel:
            await channel.configure(config)

    # ------------------------------------------------------------------ stop

    async def unit_active(self, inst: Instance) -> bool:
        if inst.unit_name is None:
            return False
        info = await self.supervisor.describe(inst.unit_name)
        return info is not None and info.active

    async def prepare_stop(self, inst: Instance, deadline_s: float) -> None:
        """stop_prepare in the guest; every failure is a ``prepare guest stop:`` error."""
        try:
            async with self.guest(inst) as channel:
                await channel.stop_prepare(trio.current_time() + deadline_s)
        except FailedPrecondition as exc:
            if exc.message.startswith("prepare guest stop:"):
                raise
            raise FailedPrecondition(f"prepare guest stop: {exc.message}",
                                     details=exc.details) from None
        except KibotosError as exc:
            raise FailedPrecondition(f"prepare guest stop: guest not reachable: "
                                     f"{exc.message}") from None

    async def short_sync(self, inst: Instance) -> bool:
        """stop --force: a short sync if the guest answers; whether it did."""
        timeout = self.settings.force_sync_timeout
        with trio.move_on_after(timeout + _GUEST_CONNECT):
            try:
                async with self.guest(inst, timeout=min(timeout, _GUEST_CONNECT)) as channel:
                    await channel.sync(timeout)
                return True
            except KibotosError as exc:
                log.warning("instance force stop: guest sync failed", instance=inst.instance_id,
                            error=exc.message)
        return False

    async def stop_unit(self, inst: Instance, *, timeout: float | None = None) -> None:
        """Stop the unit and confirm none of its processes remains; `timeout` (default
        ``stop_timeout``) is the grace between SIGTERM and SIGKILL."""
        name = inst.unit_name or unit_name_for(inst.instance_id)
        failpoints.hit("node.instance.before-stop")
        await self.supervisor.stop(name, timeout=self.settings.stop_timeout
                                   if timeout is None else timeout)
        info = await self.supervisor.describe(name)
        if info is not None and info.active:
            raise Unavailable(f"instance cleanup pending: unit {name} is still active "
                              f"(MainPID {info.main_pid}) after its stop")
        main = inst.main_process
        if main is not None and \
                await trio.to_thread.run_sync(read_process, PROC, *main) is not None:
            raise Unavailable(f"instance cleanup pending: process {main[0]} of unit {name} "
                              "still exists after its stop")
        failpoints.hit("node.instance.after-stop")

    async def release_objects(self, inst: Instance, *, confirmed_on_disk: bool) -> None:
        """Record the clean release of everything the Instance held open."""
        if inst.released:
            return
        failpoints.hit("node.instance.before-object-release")
        for obj in inst.held:
            pool = self.pool(obj.pool_id, obj.kind)
            done = await trio.to_thread.run_sync(functools.partial(
                pool.release, obj.object_id, obj.epoch, confirmed_on_disk=confirmed_on_disk))
            if not done:  # the VMM is gone: the successor still awaits our receipt
                successor = await trio.to_thread.run_sync(pool.taken_over, obj.object_id,
                                                          obj.epoch)
                if successor is not None:
                    await trio.to_thread.run_sync(functools.partial(
                        pool.fence, obj.object_id, obj.epoch, successor=successor))
                log.warning("object release skipped: another holder took it over",
                            instance=inst.instance_id, kind=obj.kind, pool=obj.pool_id,
                            object=obj.object_id, epoch=obj.epoch,
                            receipt=successor is not None)
            await self.drop_attachment(inst, obj)
        # objects of the spec it never opened (a boot cut short) leave no record either
        await trio.to_thread.run_sync(self._drop_unopened, inst, self.instance_objects(inst))
        inst.released = True
        failpoints.hit("node.instance.after-object-release")


def log_tail(path: Path, limit: int = _LOG_TAIL) -> str:
    """The last `limit` bytes of a log, as text, on one line."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - limit))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-5:])
