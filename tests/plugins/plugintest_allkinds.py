"""A test-only plugin that registers one backend of every kind through every hook.

Loaded through ``KIBOTOS_TEST_PLUGIN_MODULES`` (or ``load_plugins(test_modules=…)``),
never installed: it shows a plugin outside the tree of built-ins can fill every
registry, and it is the VMM backend the plugin tests use (there is no built-in one yet).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kibotos.sdk import (
    Availability,
    FailedPrecondition,
    HostPaths,
    NodeCapacity,
    PlacementRequest,
    PoolSpec,
    UnitInfo,
    UnitSpec,
    VmmBackend,
    hookimpl,
)


class EchoVmm(VmmBackend):
    """Runs `echo` instead of a VM; enough to show the VMM contract's shape (subclassing
    the contract gives the defaults of its optional members; the other kinds here only
    match their contract's shape)."""

    name: ClassVar[str] = "test-echo"
    CAN_MIGRATE: ClassVar[bool] = False

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = dict(options)

    async def probe(self) -> Mapping[str, Any]:
        return {"accel": "none"}

    def unit_for(self, launch: Mapping[str, Any]) -> UnitSpec:
        return UnitSpec(name=f"test-vmm-{launch['instance_id']}", argv=["echo", "booted"])

    async def wait_ready(self, launch: Mapping[str, Any], *, timeout: float
                         ) -> Mapping[str, Any]:
        return {"protocol_version": 1, "boot_id": f"echo-{launch['instance_id']}"}

    async def guest_channel(self, launch: Mapping[str, Any], *, timeout: float = 10.0
                            ) -> Any:
        raise FailedPrecondition("the echo backend has no guest agent")


class AlwaysDriver:
    name: ClassVar[str] = "test-always"

    def __init__(self, options: Mapping[str, Any]) -> None:
        pass

    def check(self, pool: PoolSpec, host: HostPaths) -> Availability:
        return Availability(True)


class ReversePolicy:
    name: ClassVar[str] = "test-reverse"

    def __init__(self, options: Mapping[str, Any]) -> None:
        pass

    def rank(self, request: PlacementRequest, candidates: Sequence[NodeCapacity]) -> list[str]:
        return sorted((c.node_id for c in candidates), reverse=True)


class NullSupervisor:
    name: ClassVar[str] = "test-null"

    def __init__(self, options: Mapping[str, Any]) -> None:
        pass

    async def start(self, spec: UnitSpec) -> UnitInfo:
        raise NotImplementedError

    async def describe(self, name: str) -> UnitInfo | None:
        return None

    async def stop(self, name: str, *, timeout: float) -> None:
        return None

    async def list(self, prefix: str) -> list[UnitInfo]:
        return []


@hookimpl
def kibotos_register_vmm(register):
    register(EchoVmm)


@hookimpl
def kibotos_register_storage_driver(register):
    register(AlwaysDriver)


@hookimpl
def kibotos_register_placement(register):
    register(ReversePolicy)


@hookimpl
def kibotos_register_supervisor(register):
    register(NullSupervisor)
