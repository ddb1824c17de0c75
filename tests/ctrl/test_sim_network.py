"""The simulated node answers ``instance.set_network`` as the real node does
(`kibotos.testing.sim_instances`; the node side is tests/node/test_instance_network.py):
a RUNNING Instance with a network switches by revision, a repeat changes nothing, an
older revision or the same one with another policy is stale, and an Instance without a
network or not RUNNING is refused with the node's reasons."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from ws_helpers import TEMPLATE_REF

from kibotos.core.errors import FailedPrecondition
from kibotos.testing.sim_instances import SimInstances

GI = 1 << 30


def create_args(instance_id: str, **extra: Any) -> dict[str, Any]:
    return {"instance_id": instance_id, "workspace_id": f"ws-{instance_id}",
            "cpu_millis": 1000, "memory_bytes": GI, "template": TEMPLATE_REF,
            "layer": {"pool_id": "p", "ref": f"lay-{instance_id}", "capacity_bytes": GI,
                      "epoch": 1, "create": True}, **extra}


def switch(instance_id: str, revision: int, **network: Any) -> dict[str, Any]:
    return {"instance_id": instance_id, "revision": revision, "network": network}


async def reason(sim: SimInstances, args: dict[str, Any]) -> str:
    with pytest.raises(FailedPrecondition) as info:
        await sim.handle("instance.set_network", args)
    return str(info.value.details["reason"])


async def test_a_switch_goes_by_revision() -> None:
    sim = SimInstances()
    async with trio.open_nursery() as nursery:
        sim.bind(None, nursery)
        hold = sim.hold_boots = trio.Event()
        await sim.handle("instance.create", create_args("i-1", network={},
                                                        network_revision=1))
        await sim.handle("instance.create", create_args("i-2"))
        await trio.testing.wait_all_tasks_blocked()
        assert await reason(sim, switch("i-1", 2)) == "not_running"
        hold.set()
        await trio.testing.wait_all_tasks_blocked()
        deny = {"deny_out": ["198.18.0.0/15"]}
        assert await sim.handle("instance.set_network", switch("i-1", 2, **deny)) == \
            {"network_revision": 2, "changed": True}
        assert await sim.handle("instance.set_network", switch("i-1", 2, **deny)) == \
            {"network_revision": 2, "changed": False}
        assert sim.instances["i-1"].network is not None
        assert sim.instances["i-1"].network.deny_out == ["198.18.0.0/15"]
        assert await reason(sim, switch("i-1", 1)) == "stale"
        assert await reason(sim, switch("i-1", 2)) == "stale"  # same revision, other policy
        assert await reason(sim, switch("i-2", 2)) == "no_network"
        nursery.cancel_scope.cancel()
