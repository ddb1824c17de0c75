"""The seam between the control session and whatever runs Instances on this node.

The session needs from it: the figures of the full report (allocated resources, counts,
and the state of every Instance, so ctrl can reconcile after a reconnect), the
``instance_state`` frames to send whenever an Instance changes, the command handlers
(``instance.create`` …), the drain flag ctrl sends, a way to destroy every Instance when
ctrl says the node was isolated, and the VM usage figures of the host-usage sample.

`kibotos.node.instances.manager.VmInstanceManager` is the real manager (VMs through a VMM backend
and a supervisor); `EmptyInstanceManager` is the manager of a node that runs none.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from kibotos.protocol import HOLDING_STATES as HOLDING_STATES
from kibotos.protocol import InstanceStatus
from kibotos.protocol.values import clip

#: Instance states as the node reports them, by their short names here: their one
#: definition is `kibotos.protocol.InstanceStatus`.
CREATING = InstanceStatus.CREATING.value
RUNNING = InstanceStatus.RUNNING.value
STOPPING = InstanceStatus.STOPPING.value
STOPPED = InstanceStatus.STOPPED.value
FAILED = InstanceStatus.FAILED.value
DESTROYED = InstanceStatus.DESTROYED.value
STATES = tuple(s.value for s in InstanceStatus)

CommandHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class InstanceSummary:
    """One Instance as ``hello``/``report`` list it."""

    instance_id: str
    workspace_id: str
    state: str
    reason: str | None = None
    #: ``{kind, pool_id, object_id, epoch, released_cleanly}`` of what it opened.
    objects: tuple[dict[str, Any], ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "workspace_id": self.workspace_id,
                "state": self.state, "reason": clip(self.reason),
                "objects": list(self.objects)}


@dataclass(frozen=True)
class Holdings:
    """What the node holds right now, as the full report states it."""

    allocated_cpu_millis: int = 0
    allocated_memory_bytes: int = 0
    instance_count: int = 0
    volume_count: int = 0
    instances: tuple[InstanceSummary, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {
            "allocated": {"cpu_millis": self.allocated_cpu_millis,
                          "memory_bytes": self.allocated_memory_bytes},
            "instance_count": self.instance_count,
            "volume_count": self.volume_count,
            "instances": [i.to_wire() for i in self.instances],
        }


class StateFeed:
    """``instance_state`` frames in order, for whichever control session is up.

    Frames are numbered; a session remembers the number it has sent up to and asks for
    the rest.  Only the latest `keep` frames are kept: a session that was down longer
    than that loses the oldest, which is harmless because every ``hello`` and ``report``
    carries the current state of every Instance.
    """

    def __init__(self, keep: int = 1000) -> None:
        self._frames: deque[tuple[int, dict[str, Any]]] = deque(maxlen=keep)
        self._seq = 0
        self._changed = trio.Event()

    @property
    def position(self) -> int:
        """The number of the latest frame (0 before the first)."""
        return self._seq

    def publish(self, frame: dict[str, Any]) -> None:
        """Add a frame; safe from any trio task, never blocks."""
        self._seq += 1
        self._frames.append((self._seq, frame))
        self._changed.set()
        self._changed = trio.Event()

    async def after(self, seen: int) -> tuple[int, list[dict[str, Any]]]:
        """The frames numbered above `seen` (waiting for one), and the new position."""
        while self._seq <= seen:
            await self._changed.wait()
        return self._seq, [frame for seq, frame in self._frames if seq > seen]


@dataclass(frozen=True)
class ManagerGauges:
    """What the node's ``/metrics`` shows of a manager beyond its holdings
    (docs/metrics.md); None leaves that gauge out, for a manager without such state."""

    drain_requested: bool | None = None
    #: What this node start did with the Instances it found: adoption verdict → count.
    adoption_counts: Mapping[str, int] | None = None
    #: Instances whose release is stuck (processes left after their unit's stop).
    cleanup_pending: int | None = None


class InstanceManager(Protocol):
    """What the node's session and `serve_node` ask of the Instance manager."""

    def set_change_callback(self, callback: Callable[[], None]) -> None:
        """`serve_node` hands over the report's change signal; the manager calls it
        whenever `holdings()` changes, so ctrl gets a fresh report at once."""

    def holdings(self) -> Holdings:
        """The current allocated resources, counts and Instance states."""

    def state_feed(self) -> StateFeed:
        """Where the ``instance_state`` frames come from."""

    def command_handlers(self) -> Mapping[str, CommandHandler]:
        """Session command handlers by kind (``instance.create`` …)."""

    def set_drain_requested(self, requested: bool) -> None:
        """ctrl's drain flag (``welcome.drain_requested``, ``node.drain``): while set,
        the node refuses creates."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Background work (boots, watching VMMs) until cancelled; `started` once the
        manager can take commands."""

    async def destroy_all(self) -> int:
        """Stop and remove every Instance (the node was isolated: its objects may
        already be in another node's hands); return how many there were."""

    def vm_usage(self) -> tuple[float | None, int | None]:
        """``(vm_cpu_cores, vm_memory_bytes)`` of all VMs on the host; None until this
        node has started a VM."""

    def gauges(self) -> ManagerGauges:
        """The manager's own figures for ``/metrics``."""


class EmptyInstanceManager:
    """The manager of a node that runs no Instances: it holds nothing, so a report says
    zero, nothing ever changes, and there is nothing to destroy or measure."""

    def __init__(self) -> None:
        self._feed = StateFeed()

    def set_change_callback(self, callback: Callable[[], None]) -> None:
        del callback  # holdings never change

    def holdings(self) -> Holdings:
        return Holdings()

    def state_feed(self) -> StateFeed:
        return self._feed

    def command_handlers(self) -> Mapping[str, CommandHandler]:
        return {}

    def set_drain_requested(self, requested: bool) -> None:
        del requested  # there is nothing to refuse

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        task_status.started()
        await trio.sleep_forever()

    async def destroy_all(self) -> int:
        return 0

    def vm_usage(self) -> tuple[float | None, int | None]:
        return None, None

    def gauges(self) -> ManagerGauges:
        return ManagerGauges()  # no drain to refuse, nothing adopted or cleaning up
