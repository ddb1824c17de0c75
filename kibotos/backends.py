"""Contracts of the backend classes that plugins register.

Each kind has a registry (`kibotos.plugins.Registries`); a backend class carries a unique
``name`` and is instantiated by the role that uses it.  Plugins import these through the
plugin SDK (`kibotos.sdk`, docs/plugins.md), as the built-in ones do.

A contract may have *optional* members: declared in its Protocol with a default
(`OPTIONAL_MEMBERS` lists them).  A backend class that subclasses its Protocol (``class
QemuVmm(VmmBackend)``) inherits the defaults; one that only matches the Protocol's shape
must define them itself, which the plugin loader checks.  Either way the role calls
them directly, never through a ``getattr`` probe, and mypy sees every call.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from kibotos.core.errors import InvalidArgument

if TYPE_CHECKING:
    import trio

# --------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class NodeCapacity:
    """One node that passed admission, as placement sees it.

    ``schedulable_*`` is what the node reported times its overcommit ratio; ``allocated_*``
    is what Allocations already hold there.  Both are exact integers (millicores, bytes).
    """

    node_id: str
    schedulable_cpu_millis: int
    schedulable_memory_bytes: int
    allocated_cpu_millis: int
    allocated_memory_bytes: int
    instance_count: int = 0

    @property
    def free_cpu_millis(self) -> int:
        return self.schedulable_cpu_millis - self.allocated_cpu_millis

    @property
    def free_memory_bytes(self) -> int:
        return self.schedulable_memory_bytes - self.allocated_memory_bytes

    def free_share_after(self, request: PlacementRequest) -> Fraction:
        """The share of this node left free once `request` is placed, CPU and memory
        combined (their mean), as an exact fraction.

        Exact, so two policies or two runs never disagree on a tie because of float
        rounding.  A resource the node has none of counts as full (share 0): such a node
        can only be a candidate for a request that needs none of it.
        """
        return (
            _share(self.free_cpu_millis - request.cpu_millis, self.schedulable_cpu_millis)
            + _share(
                self.free_memory_bytes - request.memory_bytes, self.schedulable_memory_bytes
            )
        ) / 2


    def free_share_key_after(self, request: PlacementRequest) -> int:
        """`free_share_after` as an integer with the same order: ``floor(share × 2**256)``.

        Comparing these keys is exact (equal shares give equal keys, a smaller share a
        smaller key) as long as ``2 × schedulable CPU × schedulable memory`` stays below
        2**127, far beyond any real node, because two different shares then differ by
        more than 2**-254.  Integers compare in C, a `Fraction` in Python: ranking a
        thousand nodes by this key is some thirty times cheaper.
        """
        cpu_total = self.schedulable_cpu_millis
        mem_total = self.schedulable_memory_bytes
        cpu_free = self.free_cpu_millis - request.cpu_millis if cpu_total > 0 else 0
        mem_free = self.free_memory_bytes - request.memory_bytes if mem_total > 0 else 0
        cpu_total = cpu_total if cpu_total > 0 else 1
        mem_total = mem_total if mem_total > 0 else 1
        numerator = cpu_free * mem_total + mem_free * cpu_total
        return (numerator << _KEY_BITS) // (2 * cpu_total * mem_total)


#: Bits of `NodeCapacity.free_share_key_after`: twice the largest denominator's bits.
_KEY_BITS = 256


def _share(free: int, total: int) -> Fraction:
    return Fraction(free, total) if total > 0 else Fraction(0)


@dataclass(frozen=True)
class PlacementRequest:
    cpu_millis: int
    memory_bytes: int
    labels: Mapping[str, str] = field(default_factory=dict)


@runtime_checkable
class PlacementPolicy(Protocol):
    """Ranks the nodes that passed admission; it never decides admission itself.

    `rank` gets only candidates that can hold the request and returns their node IDs,
    best first.  It may drop none and add none: ctrl checks that the result is a
    permutation of the candidates and falls back to the input order if it is not.
    """

    name: ClassVar[str]

    def __init__(self, options: Mapping[str, Any]) -> None: ...

    def rank(self, request: PlacementRequest, candidates: Sequence[NodeCapacity]) -> list[str]: ...


@runtime_checkable
class KeyedPlacementPolicy(PlacementPolicy, Protocol):
    """A policy whose ranking is a sort by a key of each candidate alone (both built-in
    policies are).  Optional: a policy that has `sort_key` promises that `rank` returns
    the candidates sorted by ``sort_key(request, candidate)``, ascending.

    ctrl then keeps each admitted node's key for the request shapes it sees and
    recomputes only the keys of nodes that changed, instead of ranking every node on
    every placement: with a thousand nodes that is the difference between a few
    microseconds and a few milliseconds per placement.  Keys of different candidates
    must be mutually comparable and should be distinct (end them with the node ID).
    """

    def sort_key(self, request: PlacementRequest, candidate: NodeCapacity) -> Any: ...


# --------------------------------------------------------------------------- storage


@dataclass(frozen=True)
class HostPaths:
    """Where the node reads kernel facts; tests point these at prepared trees."""

    proc_root: Path = Path("/proc")
    sys_root: Path = Path("/sys")


@dataclass(frozen=True)
class PoolSpec:
    id: str
    path: Path
    default: bool = False
    shared: bool = False
    driver: str = "local"
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Availability:
    """A driver's verdict.  ``reason`` says why a pool is unavailable; ``warnings`` are
    advice for a usable pool (a recommended mount option missing): logged and reported,
    never a reason to refuse the pool."""

    available: bool
    reason: str | None = None
    warnings: tuple[str, ...] = ()


@runtime_checkable
class StorageDriver(Protocol):
    """Checks that a pool's mount is usable, and makes it so where the node may.

    `check` is called at node start and on every availability refresh (at least once a
    minute); it must be cheap, must not block on an unreachable server for long, and
    returns `Availability` with a human-readable reason when the pool cannot be used.
    The marker check is done by the node before the driver is asked.
    """

    name: ClassVar[str]

    def __init__(self, options: Mapping[str, Any]) -> None: ...

    def check(self, pool: PoolSpec, host: HostPaths) -> Availability: ...


# --------------------------------------------------------------------------- supervisor


@dataclass(frozen=True)
class UnitSpec:
    """A long-running service to start: one VMM, data-plane or egress process.

    ``name`` is 1-200 characters of letters, digits and ``_.@:-``, not starting with a
    dot; it is the key of `describe`/`stop` and what `list` matches by prefix.
    ``environment`` is the unit's whole environment (as with systemd, the node's own
    environment is not inherited; ``PATH`` defaults to the usual system path).
    ``properties`` are supervisor-specific unit properties (systemd's ``MemoryMax`` …);
    a supervisor records those it cannot honour.  ``log_path`` receives stdout and
    stderr (appended); None means the supervisor's default place (the journal for
    systemd, ``<state_dir>/logs/<name>.log`` for ``direct``).
    """

    name: str
    argv: Sequence[str]
    properties: Mapping[str, Any] = field(default_factory=dict)
    environment: Mapping[str, str] = field(default_factory=dict)
    working_directory: Path | None = None
    log_path: Path | None = None


@dataclass(frozen=True)
class UnitInfo:
    """What the supervisor can prove about a unit; compared on adoption.

    ``active`` is true only while the unit's main process is the very process that was
    started (same PID *and* same start time, in this boot), so a reused PID never makes
    a dead unit look alive.  While active, the process facts (``main_pid``,
    ``start_time_ticks`` = field 22 of ``/proc/<pid>/stat``, ``executable`` and its
    ``(st_dev, st_ino)``, ``cgroup``, ``netns_inode``) are read afresh; when inactive
    they are None.  ``invocation_id`` (128-bit hex, new on every start) and ``argv``
    stay those of the last start.  ``result`` is None while active; once the main
    process is gone it says how it ended as far as the supervisor can tell (systemd:
    ``success``, ``exit-code``, ``signal``, ``oom-kill`` …; ``direct``, which is not the
    process's parent and cannot see its exit status: ``gone``).
    """

    name: str
    active: bool
    invocation_id: str | None
    main_pid: int | None
    start_time_ticks: int | None
    executable: str | None
    executable_dev_ino: tuple[int, int] | None
    cgroup: str | None
    netns_inode: int | None
    result: str | None = None
    argv: tuple[str, ...] = ()


_UNIT_NAME = re.compile(r"[A-Za-z0-9_@:-][A-Za-z0-9_.@:-]{0,199}")


def check_unit_name(name: object) -> str:
    """A unit name as every supervisor takes it (``UnitSpec.name``, and the name given
    to `Supervisor.describe` and `stop`): 1-200 letters, digits and ``_.@:-``, not
    starting with a dot; anything else is `InvalidArgument`."""
    if not isinstance(name, str) or not _UNIT_NAME.fullmatch(name):
        raise InvalidArgument(
            f"invalid unit name {name!r}: must be 1-200 letters, digits and '_.@:-', "
            "not starting with a dot"
        )
    return name


@runtime_checkable
class Supervisor(Protocol):
    """Starts, describes, lists and stops units.

    Lifecycle: `start` returns once the unit's main process exists (``Type=exec``
    semantics: the exec succeeded, or `start` raised); starting a name whose unit is
    still active is refused (`kibotos.core.errors.AlreadyExists`), while a dead one is
    replaced.  Units outlive the node process: a new supervisor object (node restart)
    finds them again.  `describe` returns None for a name it knows nothing of, and a
    `UnitInfo` with ``active=False`` for a unit whose main process ended on its own;
    `stop` ends every process of the unit (terminate, then kill after ``timeout``
    seconds), returns once none remains, forgets the unit, and is a no-op for an unknown
    name; `list` finds units by name prefix, also after the node restarted.
    """

    name: ClassVar[str]

    def __init__(self, options: Mapping[str, Any]) -> None: ...

    async def start(self, spec: UnitSpec) -> UnitInfo: ...

    async def describe(self, name: str) -> UnitInfo | None: ...

    async def stop(self, name: str, *, timeout: float) -> None: ...

    async def list(self, prefix: str) -> list[UnitInfo]: ...


# --------------------------------------------------------------------------- VMM


@runtime_checkable
class VmmBackend(Protocol):
    """Turns a launch description into a command line and unit properties.

    Lifecycle: `probe` once at node start (which acceleration works); `unit_for` builds
    the unit to start; `wait_ready` returns the guest's readiness facts or raises on the
    deadline; `guest_channel` opens the byte stream to the guest agent.  Capability
    flags (class attributes ``CAN_*``) say what the backend supports.

    Network (``CAN_NETWORK = True``): the launch then has ``network`` {``netns_path``,
    ``tap``, ``mac``} (`kibotos.vmm_launch.network`): the node made the namespace and,
    in it, a persistent tap; the backend's unit joins the namespace
    (``NetworkNamespacePath``) and its VMM opens the tap by name and gives the guest a
    virtio-net NIC with that MAC.  An optional ``tap_owner() -> (uid | None, gid |
    None)`` names the account the VMM runs as, which the node makes the tap's owner, so
    the VMM attaches to it without any capability.  Without ``CAN_NETWORK`` the node
    refuses a create with a network.
    """

    name: ClassVar[str]

    def __init__(self, options: Mapping[str, Any]) -> None: ...

    async def probe(self) -> Mapping[str, Any]: ...

    def unit_for(self, launch: Mapping[str, Any]) -> UnitSpec: ...

    async def wait_ready(self, launch: Mapping[str, Any], *, timeout: float
                         ) -> Mapping[str, Any]:
        """The guest's hello (``kibotos.guest.GuestInfo.to_json()``) once the unit of
        `launch` runs and its agent answered; raises DeadlineExceeded after `timeout`
        seconds (or FailedPrecondition when the guest visibly cannot come up).  Never
        stops the unit: on failure the caller does, through its supervisor."""
        ...

    async def guest_channel(self, launch: Mapping[str, Any], *, timeout: float = 10.0
                            ) -> trio.abc.Stream:
        """A byte stream to the guest agent of `launch`, for
        `kibotos.guest.open_guest_channel`; retries while the VMM does not listen yet."""
        ...

    # ---------------------------------------------------------------- optional members

    #: Files the backend needs in a runtime directory besides the guest agent, relative
    #: to it (``bin/kibovm``): the node keeps or pins an installation only when they
    #: are there (`kibotos.node.runtime.installations`).
    RUNTIME_FILES: ClassVar[tuple[str, ...]] = ()

    #: The guest file systems the node names in the guest's ``configure`` as
    #: ``retained_filesystems``, which ``stop_prepare`` syncs and freezes: where the
    #: kibotos Platform's init mounts the writable layer (docs/vm.md).  A backend whose
    #: guest is not a kibotos Platform says otherwise (the test backend: none).
    GUEST_RETAINED_FILESYSTEMS: ClassVar[tuple[str, ...]] = ("/run/kibotos/rw",)

    def volume_devices(self, launch: Mapping[str, Any]) -> Sequence[str] | None:
        """The guest device path of each Volume of `launch`, in launch order
        (``/dev/disk/by-id/virtio-<serial>``), which the guest's ``configure`` mounts;
        None when the backend cannot name them (a guest without block devices): the
        node then leaves the guest's Volumes alone."""
        del launch
        return None

    @property
    def dataplane_vsock_port(self) -> int | None:
        """The guest port the data plane reaches the agent on when the Instance's
        ``agent-dp.sock`` is a vsock socket (each connection starts with ``CONNECT
        <port>``); None when it is a plain stream socket (virtio-serial)."""
        return None


#: Members of each contract that have a default in its Protocol (see the module
#: docstring); every other public member is required.
OPTIONAL_MEMBERS: Mapping[type[Any], frozenset[str]] = {
    VmmBackend: frozenset({"RUNTIME_FILES", "GUEST_RETAINED_FILESYSTEMS", "volume_devices",
                           "dataplane_vsock_port"}),
}
