"""The simulated node's pool object commands (`kibotos.testing.sim_instances`), which
the Volume tests of ctrl rely on, answer as docs/architecture.md says the node does."""

from __future__ import annotations

import pytest
from ws_helpers import TEMPLATE_REF

from kibotos.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
)
from kibotos.testing.sim_instances import SimInstances

GI = 1 << 30
VOL = {"volume_id": "vol-a", "pool_id": "p", "capacity_bytes": GI, "epoch": 1}


async def test_volume_create_is_idempotent_and_fenced() -> None:
    sim = SimInstances()
    assert await sim.handle("volume.create", dict(VOL)) == {"created": True}
    assert await sim.handle("volume.create", dict(VOL)) == {"created": True}
    with pytest.raises(AlreadyExists):
        await sim.handle("volume.create", {**VOL, "capacity_bytes": 2 * GI})
    await sim.handle("volume.delete", {"volume_id": "vol-a", "pool_id": "p", "epoch": 3})
    assert sim.objects == {}
    await sim.handle("volume.create", {**VOL, "epoch": 3})
    with pytest.raises(FailedPrecondition, match="taken over"):
        await sim.handle("volume.delete", {"volume_id": "vol-a", "pool_id": "p", "epoch": 2})
    assert ("volume", "p", "vol-a") in sim.objects
    # Deleting what is not there is fine.
    assert await sim.handle("volume.delete", {"volume_id": "vol-x", "pool_id": "p",
                                              "epoch": 1}) == {"deleted": True}


async def test_expand_and_copy() -> None:
    sim = SimInstances()
    await sim.handle("volume.create", dict(VOL))
    expand = {"kind": "volume", "pool_id": "p", "object_id": "vol-a", "epoch": 1}
    assert await sim.handle("object.expand", {**expand, "capacity_bytes": 2 * GI}) == {
        "capacity_bytes": 2 * GI}
    with pytest.raises(InvalidArgument):
        await sim.handle("object.expand", {**expand, "capacity_bytes": GI})
    with pytest.raises(NotFound):
        await sim.handle("object.expand", {**expand, "object_id": "vol-x",
                                           "capacity_bytes": 2 * GI})
    assert await sim.handle("object.copy", {"kind": "volume", "object_id": "vol-a",
                                            "from_pool_id": "p", "to_pool_id": "q",
                                            "epoch": 1}) == {"copied": True}
    assert sim.objects[("volume", "q", "vol-a")].capacity_bytes == 2 * GI


async def test_objects_in_use_and_injected_failures() -> None:
    sim = SimInstances()
    await sim.handle("volume.create", dict(VOL))
    await sim.handle("instance.create", {
        "instance_id": "inst-1", "workspace_id": "ws-1", "cpu_millis": 1000,
        "memory_bytes": GI, "template": TEMPLATE_REF,
        "layer": {"pool_id": "p", "ref": "lay-1", "capacity_bytes": GI, "epoch": 1,
                  "create": True},
        "volumes": [{"volume_id": "vol-a", "pool_id": "p", "epoch": 1}]})
    assert ("retained_layer", "p", "lay-1") in sim.objects
    with pytest.raises(FailedPrecondition, match="open in Instance inst-1"):
        await sim.handle("volume.delete", {"volume_id": "vol-a", "pool_id": "p", "epoch": 1})
    with pytest.raises(FailedPrecondition):
        await sim.handle("object.expand", {"kind": "retained_layer", "pool_id": "p",
                                           "object_id": "lay-1", "epoch": 1,
                                           "capacity_bytes": 2 * GI})
    await sim.handle("instance.destroy", {"instance_id": "inst-1"})
    sim.fail_objects = Internal("disk on fire")
    with pytest.raises(Internal):
        await sim.handle("volume.delete", {"volume_id": "vol-a", "pool_id": "p", "epoch": 1})
    # The injected failure is used once.
    await sim.handle("volume.delete", {"volume_id": "vol-a", "pool_id": "p", "epoch": 1})
    assert ("volume", "p", "vol-a") not in sim.objects
