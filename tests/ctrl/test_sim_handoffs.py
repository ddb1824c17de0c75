"""The simulated node reports each object's handoff (``objects[].released_cleanly``)
the way the real node does (`kibotos.testing.sim_instances`; the node side is
tests/node/test_handoff_report.py), which the ctrl handoff tests rely on."""

from __future__ import annotations

from typing import Any

from ws_helpers import TEMPLATE_REF

from kibotos.testing.sim_instances import SimInstances, SimObject

GI = 1 << 30


def create_args(instance_id: str, epoch: int, *, create: bool,
                volumes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"instance_id": instance_id, "workspace_id": "ws-1", "cpu_millis": 1000,
            "memory_bytes": GI, "template": TEMPLATE_REF,
            "layer": {"pool_id": "p", "ref": "lay-1", "capacity_bytes": GI, "epoch": epoch,
                      "create": create},
            "volumes": volumes or []}


def clean(sim: SimInstances, instance_id: str) -> list[bool | None]:
    entry = next(i for i in sim.report_fields()["instances"]
                 if i["instance_id"] == instance_id)
    return [o["released_cleanly"] for o in entry["objects"]]


async def test_new_retry_takeover_and_clean_handoffs() -> None:
    shared: dict[Any, SimObject] = {}
    a, b = SimInstances(objects=shared), SimInstances(objects=shared)
    await a.handle("volume.create", {"volume_id": "vol-1", "pool_id": "p",
                                     "capacity_bytes": GI, "epoch": 1})
    vols = [{"volume_id": "vol-1", "pool_id": "p", "epoch": 1}]
    await a.handle("instance.create", create_args("inst-1", 1, create=True, volumes=vols))
    # A new layer: no handoff; the Volume after its create's release: clean.
    assert clean(a, "inst-1") == [None, True]
    assert a.report_fields()["instances"][0]["objects"][0] == {
        "kind": "retained-layers", "pool_id": "p", "object_id": "lay-1", "epoch": 1,
        "released_cleanly": None}
    # node-a never releases (it went away): node-b takes over at epoch 2.
    vols2 = [{"volume_id": "vol-1", "pool_id": "p", "epoch": 2}]
    await b.handle("instance.create", create_args("inst-2", 2, create=False, volumes=vols2))
    assert clean(b, "inst-2") == [False, False]
    # node-a coming back and destroying its old Instance writes no receipt over epoch 2.
    await a.handle("instance.destroy", {"instance_id": "inst-1"})
    assert shared[("retained_layer", "p", "lay-1")].released is False
    # A normal stop on node-b, then node-b again at the same epoch: clean.
    await b.handle("instance.stop", {"instance_id": "inst-2", "force": False})
    await b.handle("instance.destroy", {"instance_id": "inst-2"})
    await b.handle("instance.create", create_args("inst-3", 2, create=False, volumes=vols2))
    assert clean(b, "inst-3") == [True, True]
    # A stale epoch is what the node refuses: reported as no handoff, nothing taken.
    await a.handle("instance.create", create_args("inst-4", 1, create=False))
    assert clean(a, "inst-4") == [None]
    assert shared[("retained_layer", "p", "lay-1")].epoch == 2
