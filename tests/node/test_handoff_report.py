"""How each object of an Instance came to its node (``released_cleanly``), as the
``instance_state`` frames, the report entries and ``instance.json`` carry it: two real
node managers (``direct`` supervisor, ``testvmm`` units) on one shared pool directory.

A takeover from a node that went away without releasing waits out the receipt wait
and says ``false``; after a normal stop the next node says ``true``; the node that
released the object itself and opens it again says ``true`` too; a new layer says
``null`` (no handoff)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from instance_harness import running_node, short_dir

from kibotos.node.instances.contract import FAILED, RUNNING, STOPPED
from kibotos.node.instances.lifecycle import HeldObject, Instance


def layer_entry(epoch: int, clean: bool | None) -> dict[str, Any]:
    return {"kind": "retained-layers", "pool_id": "pool-a", "object_id": "ws-1",
            "epoch": epoch, "released_cleanly": clean}


def persisted(root: Path, instance_id: str) -> list[dict[str, Any]]:
    record = json.loads((root / "runtime" / "instances" / instance_id / "instance.json")
                        .read_text())
    return list(record["held"])


async def start(node: Any, instance_id: str, **kw: Any) -> dict[str, Any]:
    assert await node.command("instance.create", node.create_args(instance_id, **kw)) == \
        {"accepted": True}
    frame = await node.wait_state(instance_id, RUNNING, FAILED)
    assert frame["state"] == RUNNING, frame
    return frame


def report_objects(node: Any, instance_id: str) -> list[dict[str, Any]]:
    entries = node.manager.holdings().to_wire()["instances"]
    return next(e["objects"] for e in entries if e["instance_id"] == instance_id)


async def test_takeover_without_receipt_says_false_and_clean_handoffs_say_true() -> None:
    pool_dir = short_dir("kp-")
    pool = pool_dir / "pool"
    try:
        # node-a makes the layer, then goes away without releasing it (its manager is
        # gone and its unit stopped: no release, no receipt).
        async with running_node(shared=True, pool=pool, node_id="node-a") as a:
            first = await start(a, "inst-1")
            assert first["objects"] == [layer_entry(1, None)]  # a new layer
            assert report_objects(a, "inst-1") == [layer_entry(1, None)]

        async with running_node(shared=True, pool=pool, node_id="node-b",
                                receipt_wait=1.0) as b:
            taken = await start(b, "inst-2", epoch=2, create=False)
            assert taken["objects"] == [layer_entry(2, False)]
            assert report_objects(b, "inst-2") == [layer_entry(2, False)]
            assert persisted(b.root, "inst-2") == [layer_entry(2, False)]
            # A normal stop releases it cleanly; node-b opening it again itself (same
            # epoch, as ctrl grants it to the node that had it) is a clean handoff.
            await b.command("instance.stop", {"instance_id": "inst-2", "force": False,
                                              "deadline_s": 10})
            await b.wait_state("inst-2", STOPPED)
            again = await start(b, "inst-3", epoch=2, create=False)
            assert again["objects"] == [layer_entry(2, True)]
            await b.command("instance.stop", {"instance_id": "inst-3", "force": False,
                                              "deadline_s": 10})
            await b.wait_state("inst-3", STOPPED)

        # Another node after that normal stop: the clean release is found at once.
        async with running_node(shared=True, pool=pool, node_id="node-c") as c:
            moved = await start(c, "inst-4", epoch=3, create=False)
            assert moved["objects"] == [layer_entry(3, True)]
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)


def test_instance_records_of_older_nodes_read_as_no_handoff(tmp_path: Path) -> None:
    """An ``instance.json`` written before ``released_cleanly`` existed still loads;
    a retry's open (None) keeps what the first open found."""
    spec = {"instance_id": "inst-1", "workspace_id": "ws-1",
            "template": {"name": "t", "image_digest": "sha256:" + "ab" * 32,
                         "kernel_digest": "sha256:" + "cd" * 32,
                         "initramfs_digest": "sha256:" + "ef" * 32},
            "cpu_millis": 1000, "memory_bytes": 128 << 20,
            "layer": {"pool_id": "pool-a", "ref": "ws-1", "capacity_bytes": 32 << 20,
                      "epoch": 1, "create": True},
            "volumes": [], "launch": {"hostname": "h", "env": {}}}
    old = {"spec": spec, "state": "RUNNING",
           "held": [{"kind": "retained-layers", "pool_id": "pool-a", "object_id": "ws-1",
                     "epoch": 1}]}
    inst = Instance.from_record(tmp_path, old)
    assert inst.objects_wire() == [layer_entry(1, None)]
    again = Instance.from_record(tmp_path, inst.to_record())
    assert again.held == inst.held

    held = HeldObject("retained-layers", "pool-a", "ws-1", 1, False)
    inst.held = [held]
    assert HeldObject("retained-layers", "pool-a", "ws-1", 1, None) in inst.held
    assert Instance.from_record(tmp_path, inst.to_record()).objects_wire() == \
        [layer_entry(1, False)]
