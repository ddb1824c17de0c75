"""The Instance side of a simulated node: answers the Instance commands of
docs/architecture.md ("Session commands for Instances") the way the real node's
`VmInstanceManager` does, without VMs, so ctrl's Workspace code can be tested (and
benchmarked with a thousand nodes) against real sessions.

Every command's arguments are parsed with its type in `kibotos.protocol` (the one the
real node parses with, and ctrl builds from), so what the real node refuses (a
``"template": {}``, a memory size below 64 MiB, an unknown field) the simulation
refuses too, with the same ``invalid_argument`` naming the field.

* ``instance.create`` admits like the node (refused while drained, ``memory_tight``
  while memory is tight), is idempotent by ID, answers ``{accepted: true}`` at once and
  "boots" in the background: CREATING, then RUNNING after `boot_delay` (or FAILED with
  `fail_boot`), each an ``instance_state`` frame, each followed by a report;
* ``instance.stop`` → STOPPING, STOPPED, ``{confirmed_on_disk: not force}``;
* ``instance.destroy`` → DESTROYED, the Instance forgotten;
* ``layer.delete`` and ``node.drain`` are recorded;
* ``instance.set_network`` switches a RUNNING Instance that has a network as the node
  does: an older revision than the one in force, or the same revision with another
  policy, is refused (``failed_precondition``, reason ``stale``), a repeat answers
  ``changed: false``; the policy in force is the Instance's `network`;
* the pool object commands (``volume.create``, ``volume.delete``, ``object.expand``,
  ``object.copy``) work on `objects`, a simulated pool content keyed by (kind, pool,
  object ID) with each object's capacity and holder epoch; an older epoch than the
  recorded one is refused as the node refuses a taken-over use right.  Nodes attached
  to one shared pool can be given the same `objects` dict;
* an Instance "opens" its layer and Volumes at create and reports each handoff as the
  node does (``objects`` of its frames and report entries, ``released_cleanly``): null
  for a new object or a retry, true after a release (a stop or destroy on any node
  sharing `objects`), false when the previous holder never released it (its node
  went away: the node waited for a receipt in vain).

Other command kinds are left unanswered, for a test to answer by hand.

Knobs a test turns: `drain_requested`, `memory_tight`, `boot_delay`, `hold_boots`,
`fail_boot`, `refuse_stop`, `fail_objects` (the error of the next pool object command),
`hold_objects` (pool object commands wait for it), `fail_network` (the error of the
next network switch), `guest_addresses` (sent in a networked Instance's RUNNING
frame), `before_command` (awaited before each command is answered);
`exit(instance_id, reason)` plays a VMM that ended on its own (reason ``oom_killed``
for the OOM killer).  Every command
received is kept in `commands`.  One object can outlive a session: pass it to the next
`open_sim_node` and the node "restarts" with its Instances.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import trio

from kibotos.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KibotosError,
    NotFound,
    ResourceExhausted,
)
from kibotos.protocol import (
    HELD_KIND_OF,
    HOLDING_STATES,
    Args,
    CreateSpec,
    DestroyArgs,
    DrainArgs,
    InstanceState,
    LayerDeleteArgs,
    LayerRef,
    NetworkPolicy,
    ObjectCopyArgs,
    ObjectExpandArgs,
    Report,
    SetNetworkArgs,
    StopArgs,
    VolumeCreateArgs,
    VolumeDeleteArgs,
    parse_args,
)
from kibotos.protocol.values import clip

EXITED_REASON = "node reports the Instance as no longer running"
OOM_REASON = "oom_killed"
HOLDING = HOLDING_STATES

Send = Callable[[dict[str, Any]], Awaitable[None]]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class SimInstance:
    instance_id: str
    workspace_id: str
    cpu_millis: int
    memory_bytes: int
    layer: LayerRef
    spec: CreateSpec
    state: str = "CREATING"
    reason: str | None = None
    #: ``{kind, pool_id, object_id, epoch, released_cleanly}`` as the node reports them.
    objects: list[dict[str, Any]] = field(default_factory=list)
    #: The network policy in force and its revision (from the create or a switch).
    network: NetworkPolicy | None = None
    network_revision: int | None = None


@dataclass
class SimObject:
    """A block file in a simulated pool; `released` is whether its last holder let go
    of it (a release receipt exists)."""

    capacity_bytes: int
    epoch: int
    released: bool = True


#: ctrl's object kinds → the node's (its pool directories), as ``objects`` names them.
NODE_KINDS = {kind.value: held.value for kind, held in HELD_KIND_OF.items()}


TAKEN_OVER = "the use right was taken over by a newer epoch; retrying will not succeed"


@dataclass
class SimInstances:
    drain_requested: bool = False
    memory_tight: bool = False
    boot_delay: float = 0.0
    fail_boot: str | None = None
    refuse_stop: KibotosError | None = None
    auto_report: bool = True
    #: While set (and not yet set off), boots wait for it: a test sees CREATING.
    hold_boots: trio.Event | None = None
    instances: dict[str, SimInstance] = field(default_factory=dict)
    destroyed: set[str] = field(default_factory=set)
    deleted_layers: list[tuple[str, str, int]] = field(default_factory=list)
    objects: dict[tuple[str, str, str], SimObject] = field(default_factory=dict)
    fail_objects: KibotosError | None = None
    hold_objects: trio.Event | None = None
    #: The error of the next ``instance.set_network`` (then cleared).
    fail_network: KibotosError | None = None
    #: Set: an ``instance.set_network`` is applied, then its answer waits for this
    #: event (a test lets ctrl's call time out: the answer lost after the switch).
    hold_network_answer: trio.Event | None = None
    #: Addresses the RUNNING frame of a networked Instance carries (none when empty).
    guest_addresses: list[str] = field(default_factory=list)
    #: Awaited with every command's parsed arguments before it is answered (a test
    #: plays what a node does meanwhile, e.g. fetch an Egress's credentials).
    before_command: Callable[[Args], Awaitable[None]] | None = None
    commands: list[dict[str, Any]] = field(default_factory=list)
    _send: Send | None = None
    _nursery: trio.Nursery | None = None
    _reporting: bool = False
    _report_again: bool = False

    def bind(self, send: Send | None, nursery: trio.Nursery | None) -> None:
        """Attach to the session that is up now, or detach (None) when it ended
        (`open_sim_node` does both); detached, nothing is sent and nothing boots."""
        self._send, self._nursery = send, nursery

    # ------------------------------------------------------------------ what it reports

    def report_fields(self) -> dict[str, Any]:
        held = [i for i in self.instances.values() if i.state in HOLDING]
        return {
            "allocated": {"cpu_millis": sum(i.cpu_millis for i in held),
                          "memory_bytes": sum(i.memory_bytes for i in held)},
            "instance_count": len(held), "volume_count": 0,
            "memory_tight": self.memory_tight,
            "memory_tight_since": _now() if self.memory_tight else None,
            "instances": [{"instance_id": i.instance_id, "workspace_id": i.workspace_id,
                           "state": i.state, "reason": i.reason, "objects": i.objects}
                          for i in sorted(self.instances.values(),
                                          key=lambda i: i.instance_id)],
        }

    async def report(self) -> None:
        if self._send is not None:
            await self._send(Report.model_validate(self.report_fields()).to_wire())

    async def _set(self, inst: SimInstance, state: str, reason: str | None = None) -> None:
        inst.state, inst.reason = state, reason
        if self._send is None:
            return
        frame: dict[str, Any] = {"type": "instance_state", "instance_id": inst.instance_id,
                                 "workspace_id": inst.workspace_id, "state": state,
                                 "reason": clip(reason), "at": _now(), "objects": inst.objects}
        if state == "RUNNING":
            frame["guest"] = {"boot_id": f"boot-{inst.instance_id}", "capabilities": []}
            if inst.network is not None and self.guest_addresses:
                frame["addresses"] = list(self.guest_addresses)
        await self._send(InstanceState.model_validate(frame).to_wire())
        if self.auto_report:
            self._report_soon()

    def _report_soon(self) -> None:
        """One report for the changes of this moment, as the real node's reporter
        sends one per change of its holdings, not one per frame."""
        self._report_again = True
        if not self._reporting and self._nursery is not None:
            self._reporting = True
            self._nursery.start_soon(self._reporter)

    async def _reporter(self) -> None:
        try:
            while self._report_again:
                self._report_again = False
                await trio.lowlevel.checkpoint()
                await self.report()
        finally:
            self._reporting = False

    async def exit(self, instance_id: str, reason: str = EXITED_REASON) -> None:
        """The VMM of a RUNNING Instance ended on its own (``oom_killed``: the kernel's
        OOM killer); the Instance keeps its resources, as on the real node."""
        await self._set(self.instances[instance_id], "FAILED", reason)

    async def set_memory_tight(self, tight: bool) -> None:
        self.memory_tight = tight
        await self.report()

    # ------------------------------------------------------------------ commands

    def handles(self, kind: str) -> bool:
        return kind in self.KINDS

    async def handle(self, kind: str, args: dict[str, Any]) -> dict[str, Any]:
        self.commands.append({"kind": kind, "args": args})
        model = self.ARGS.get(kind)
        if model is None:
            raise InvalidArgument(f"unknown command kind {kind!r} for this node")
        parsed = parse_args(model, args)
        if self.before_command is not None:
            await self.before_command(parsed)
        return await self._DOES[type(parsed)](self, parsed)

    async def _create(self, spec: CreateSpec) -> dict[str, Any]:
        instance_id = spec.instance_id
        existing = self.instances.get(instance_id)
        if existing is not None:
            if existing.spec.digest() == spec.digest():
                return {"accepted": True}
            raise AlreadyExists(f"Instance {instance_id} already exists with other arguments")
        if instance_id in self.destroyed:
            raise FailedPrecondition(f"Instance {instance_id} was destroyed on this node")
        if self.drain_requested:
            raise FailedPrecondition("node is drained: it takes no new Instances",
                                     details={"reason": "drained"})
        if self.memory_tight:
            raise ResourceExhausted("host memory is tight: it takes no new Instances",
                                    details={"reason": "memory_tight"})
        layer = spec.layer
        for other in self.instances.values():
            if other.state in HOLDING and other.layer.ref == layer.ref:
                raise FailedPrecondition(f"retained layer {layer.ref} is in use by "
                                         f"Instance {other.instance_id}")
        inst = SimInstance(instance_id, spec.workspace_id, spec.cpu_millis,
                           spec.memory_bytes, layer, spec, network=spec.network,
                           network_revision=spec.network_revision)
        key = ("retained_layer", layer.pool_id, layer.ref)
        if layer.create and key not in self.objects:
            self.objects[key] = SimObject(layer.capacity_bytes, layer.epoch, released=False)
        inst.objects = [self._open(key, layer.epoch)]
        inst.objects += [self._open(("volume", v.pool_id, v.volume_id), v.epoch)
                         for v in spec.volumes]
        self.instances[instance_id] = inst
        if self._nursery is not None:
            self._nursery.start_soon(self._boot, inst)
        return {"accepted": True}

    async def _set_network(self, args: SetNetworkArgs) -> dict[str, Any]:
        """A network switch, as the node answers it (`kibotos.node.instances.
        network_switch`): the whole policy replaced at once, by revision."""
        inst = self.instances.get(args.instance_id)
        if inst is None:
            raise NotFound(f"Instance {args.instance_id} is not on this node")
        if self.fail_network is not None:
            error, self.fail_network = self.fail_network, None
            raise error
        if inst.network is None:
            raise FailedPrecondition(f"Instance {args.instance_id} was created without a "
                                     "network", details={"reason": "no_network"})
        if inst.state != "RUNNING":
            raise FailedPrecondition(f"Instance {args.instance_id} is {inst.state}: a network "
                                     "switch needs it RUNNING", details={"reason": "not_running"})
        current = inst.network_revision
        if current is not None and (args.revision < current or (
                args.revision == current and args.network != inst.network)):
            raise FailedPrecondition(f"network revision {args.revision} of Instance "
                                     f"{args.instance_id} is stale (revision {current} is in "
                                     "force)", details={"reason": "stale"})
        changed = args.revision != current
        inst.network, inst.network_revision = args.network, args.revision
        if self.hold_network_answer is not None:
            await self.hold_network_answer.wait()
        return {"network_revision": args.revision, "changed": changed}

    async def _boot(self, inst: SimInstance) -> None:
        await self._set(inst, "CREATING")
        if self.hold_boots is not None:
            await self.hold_boots.wait()
        if self.boot_delay:
            await trio.sleep(self.boot_delay)
        if inst.state != "CREATING":
            return  # stopped or destroyed meanwhile
        if self.fail_boot is not None:
            await self._set(inst, "FAILED", self.fail_boot)
        else:
            await self._set(inst, "RUNNING")

    def _open(self, key: tuple[str, str, str], epoch: int) -> dict[str, Any]:
        """Take the object at `epoch` the way the node's takeover table does and say
        how it came (see the module docstring)."""
        found = self.objects.get(key)
        clean: bool | None = None
        if found is not None and found.epoch <= epoch:  # a newer epoch: the node refuses
            if found.epoch < epoch or found.released:
                clean = found.released
            found.epoch, found.released = epoch, False
        return {"kind": NODE_KINDS[key[0]], "pool_id": key[1], "object_id": key[2],
                "epoch": epoch, "released_cleanly": clean}

    def _release(self, inst: SimInstance) -> None:
        """The Instance ended: each object it opened gets its release receipt (unless
        a newer epoch took it over meanwhile)."""
        for obj in inst.objects:
            kind = next(k for k, v in NODE_KINDS.items() if v == obj["kind"])
            found = self.objects.get((kind, obj["pool_id"], obj["object_id"]))
            if found is not None and found.epoch == obj["epoch"]:
                found.released = True

    async def _stop(self, args: StopArgs) -> dict[str, Any]:
        inst = self.instances.get(args.instance_id)
        if inst is None:
            raise NotFound(f"Instance {args.instance_id} is not on this node")
        if self.refuse_stop is not None:
            await self._set(inst, "FAILED", self.refuse_stop.message)
            raise self.refuse_stop
        force = args.force
        if inst.state == "STOPPED":
            return {"confirmed_on_disk": not force}
        running = inst.state == "RUNNING"
        await self._set(inst, "STOPPING")
        self._release(inst)
        await self._set(inst, "STOPPED")
        return {"confirmed_on_disk": running and not force}

    async def _destroy(self, args: DestroyArgs) -> dict[str, Any]:
        inst = self.instances.pop(args.instance_id, None)
        if inst is not None:
            self.destroyed.add(inst.instance_id)
            self._release(inst)
            await self._set(inst, "DESTROYED")
        return {"destroyed": True}

    async def _layer_delete(self, args: LayerDeleteArgs) -> dict[str, Any]:
        await self._object_gate()
        key = ("retained_layer", args.pool_id, args.ref)
        self._check_epoch(key, args.epoch)
        self.objects.pop(key, None)
        self.deleted_layers.append((args.pool_id, args.ref, args.epoch))
        return {"deleted": True}

    # ------------------------------------------------------------------ pool objects

    async def _object_gate(self) -> None:
        if self.hold_objects is not None:
            await self.hold_objects.wait()
        if self.fail_objects is not None:
            error, self.fail_objects = self.fail_objects, None
            raise error

    def _check_epoch(self, key: tuple[str, str, str], epoch: int) -> None:
        found = self.objects.get(key)
        if found is not None and found.epoch > epoch:
            raise FailedPrecondition(f"{key[0]} {key[2]}: {TAKEN_OVER}",
                                     details={"reason": "taken_over"})
        if found is not None:
            found.epoch = epoch

    def _in_use(self, kind: str, pool_id: str, object_id: str) -> str | None:
        for inst in self.instances.values():
            if inst.state not in HOLDING:
                continue
            if kind == "retained_layer" and inst.layer.ref == object_id \
                    and inst.layer.pool_id == pool_id:
                return inst.instance_id
            for vol in inst.spec.volumes:
                if vol.volume_id == object_id and vol.pool_id == pool_id:
                    return inst.instance_id
        return None

    def _object(self, kind: str, pool_id: str, object_id: str) -> SimObject:
        found = self.objects.get((kind, pool_id, object_id))
        if found is None:
            raise NotFound(f"{kind} {object_id} is not in pool {pool_id}")
        return found

    async def _volume_create(self, args: VolumeCreateArgs) -> dict[str, Any]:
        await self._object_gate()
        key = ("volume", args.pool_id, args.volume_id)
        capacity, epoch = args.capacity_bytes, args.epoch
        existing = self.objects.get(key)
        if existing is not None:
            self._check_epoch(key, epoch)
            if existing.capacity_bytes != capacity:
                raise AlreadyExists(f"volume {key[2]} exists with another capacity")
            return {"created": True}
        self.objects[key] = SimObject(capacity, epoch)
        return {"created": True}

    async def _volume_delete(self, args: VolumeDeleteArgs) -> dict[str, Any]:
        await self._object_gate()
        pool_id, volume_id = args.pool_id, args.volume_id
        holder = self._in_use("volume", pool_id, volume_id)
        if holder is not None:
            raise FailedPrecondition(f"volume {volume_id} is open in Instance {holder}")
        key = ("volume", pool_id, volume_id)
        self._check_epoch(key, args.epoch)
        self.objects.pop(key, None)
        return {"deleted": True}

    async def _expand(self, args: ObjectExpandArgs) -> dict[str, Any]:
        await self._object_gate()
        kind, pool_id, object_id = args.kind.value, args.pool_id, args.object_id
        found = self._object(kind, pool_id, object_id)
        self._check_epoch((kind, pool_id, object_id), args.epoch)
        if self._in_use(kind, pool_id, object_id) is not None:
            raise FailedPrecondition(f"{kind} {object_id} is open in an Instance")
        capacity = args.capacity_bytes
        if capacity < found.capacity_bytes:
            raise InvalidArgument(f"{kind} {object_id} has {found.capacity_bytes} bytes; "
                                  "block files only grow")
        found.capacity_bytes = capacity
        return {"capacity_bytes": capacity}

    async def _copy(self, args: ObjectCopyArgs) -> dict[str, Any]:
        await self._object_gate()
        kind, object_id = args.kind.value, args.object_id
        source = self._object(kind, args.from_pool_id, object_id)
        self._check_epoch((kind, args.from_pool_id, object_id), args.epoch)
        self.objects[(kind, args.to_pool_id, object_id)] = SimObject(
            source.capacity_bytes, args.epoch)
        return {"copied": True}

    async def _drain(self, args: DrainArgs) -> dict[str, Any]:
        self.drain_requested = args.requested
        return {"drain_requested": self.drain_requested}

    async def destroy_all(self) -> int:
        """What a node told it was isolated does before it exits."""
        ids = list(self.instances)
        for instance_id in ids:
            await self._destroy(DestroyArgs(instance_id=instance_id))
        return len(ids)

    #: The commands it answers, by their arguments' type: the method that does each.
    _DOES: ClassVar[dict[type[Args], Callable[[SimInstances, Any],
                                              Awaitable[dict[str, Any]]]]] = {
        CreateSpec: _create, StopArgs: _stop, DestroyArgs: _destroy,
        LayerDeleteArgs: _layer_delete, DrainArgs: _drain, VolumeCreateArgs: _volume_create,
        VolumeDeleteArgs: _volume_delete, ObjectExpandArgs: _expand, ObjectCopyArgs: _copy,
        SetNetworkArgs: _set_network}
    #: The commands it answers; their arguments' types.
    ARGS: ClassVar[dict[str, type[Args]]] = {cls.KIND: cls for cls in _DOES}
    KINDS: ClassVar[tuple[str, ...]] = tuple(ARGS)
