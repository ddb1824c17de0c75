"""The seam between the control session and whatever runs Instances on this node.

The session needs three things from it: the figures of the full report (allocated
resources, Instance and Volume counts), a way to destroy every Instance when ctrl says
the node was isolated, and the VM usage figures of the host-usage sample.  Today the
node runs no Instances, so `EmptyInstanceManager` is the real manager of a node with
none; the VMM issue replaces it with one that launches and adopts VMs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Holdings:
    """What the node holds right now, as the full report states it."""

    allocated_cpu_millis: int = 0
    allocated_memory_bytes: int = 0
    instance_count: int = 0
    volume_count: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "allocated": {"cpu_millis": self.allocated_cpu_millis,
                          "memory_bytes": self.allocated_memory_bytes},
            "instance_count": self.instance_count,
            "volume_count": self.volume_count,
        }


class InstanceManager(Protocol):
    """What the session asks of the Instance manager."""

    def set_change_callback(self, callback: Callable[[], None]) -> None:
        """`serve_node` hands over the report's change signal; the manager calls it
        whenever `holdings()` changes, so ctrl gets a fresh report at once."""

    def holdings(self) -> Holdings:
        """The current allocated resources and counts."""

    async def destroy_all(self) -> int:
        """Stop and remove every Instance (the node was isolated: its objects may
        already be in another node's hands); return how many there were."""

    def vm_usage(self) -> tuple[float | None, int | None]:
        """``(vm_cpu_cores, vm_memory_bytes)`` of all VMs on the host; None until this
        node has started a VM."""


class EmptyInstanceManager:
    """The manager of a node that has no VMM backend wired in: it holds nothing, so a
    report says zero, nothing ever changes, and there is nothing to destroy or measure."""

    def set_change_callback(self, callback: Callable[[], None]) -> None:
        del callback  # holdings never change

    def holdings(self) -> Holdings:
        return Holdings()

    async def destroy_all(self) -> int:
        return 0

    def vm_usage(self) -> tuple[float | None, int | None]:
        return None, None
