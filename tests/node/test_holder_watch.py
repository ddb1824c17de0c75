"""The node's holder check (`kibotos.node.storage.holder_watch`) and the takeover rows that
need a whole Instance: a running Instance whose use right another node took is stopped,
its receipts written and it is FAILED; one still holding everything is left alone; a
Workspace taking over its layer and a Volume writes both holder records before it waits,
so the two receipts are awaited together."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from adoption_harness import alive
from instance_harness import DEADLINE, Node, running_node

from kibotos.core import atomicfile
from kibotos.node.instances.contract import FAILED, RUNNING, STOPPED
from kibotos.node.storage.holder_watch import TAKEN_OVER
from kibotos.node.storage.objects import RETAINED_LAYERS, VOLUMES, PoolObjects

MIB = 1 << 20


def rec(pool: Path, kind: str, sub: str, name: str) -> dict[str, Any]:
    value = atomicfile.read_json(pool / kind / sub / f"{name}.json")
    assert isinstance(value, dict)
    return value


async def make_volume(pool: Path, node: str = "node-a", epoch: int = 1) -> None:
    vols = PoolObjects("pool-a", pool, VOLUMES, node)
    await vols.open("vol-1", epoch, create_capacity=16 * MIB)
    assert vols.release("vol-1", epoch, confirmed_on_disk=True)


async def start(node: Node) -> None:
    await make_volume(node.pool)
    await node.command("instance.create", node.create_args(
        volumes=[{"pool_id": "pool-a", "volume_id": "vol-1", "epoch": 1}]))
    await node.wait_state("inst-1", RUNNING)


async def test_taken_over_instance_is_stopped_receipted_and_failed() -> None:
    async with running_node(shared=True) as node:
        await start(node)
        inst = node.manager.get("inst-1")
        assert inst is not None
        assert inst.main_process is not None
        pid = inst.main_process[0]
        watch = node.holder_check()
        assert await watch.check() == []  # nobody took anything: nothing happens
        assert node.manager.get("inst-1").state == RUNNING  # type: ignore[union-attr]

        # node-b takes the Volume at epoch 2 (ctrl re-granted it after an isolate).
        other = PoolObjects("pool-a", node.pool, VOLUMES, "node-b")
        await other.take("vol-1", 2, may_create=False)
        assert await watch.check() == ["inst-1"]

        frame = await node.wait_state("inst-1", FAILED)
        assert frame["reason"].startswith(TAKEN_OVER)
        assert "volume vol-1 in pool pool-a is held by node node-b at epoch 2" in \
            frame["reason"]
        assert not alive(pid)  # the VMM stopped writing
        receipt = rec(node.pool, VOLUMES, "releases", "vol-1")
        assert (receipt["node_id"], receipt["epoch"], receipt["reason"]) == \
            ("node-a", 1, "taken_over")
        # The layer was not taken over: released the ordinary way.
        layer_meta = rec(node.pool, RETAINED_LAYERS, "metadata", "ws-1")
        assert (layer_meta["state"], layer_meta["epoch"]) == ("released", 1)
        # The Volume's metadata is the successor's to write: untouched by node-a.
        vol_meta = rec(node.pool, VOLUMES, "metadata", "vol-1")
        assert vol_meta["state"] == "attached"
        assert vol_meta["epoch"] == 1

        # node-b opens without waiting: the receipt is there.
        opened = await other.open("vol-1", 2)  # finishes its takeover at epoch 2
        assert opened.handoff_clean is True  # False after a 15 s wait without one
        assert await watch.check() == []  # fenced once; nothing more to do

        # ctrl's later stop of the FAILED Instance ends it without touching the records.
        before = rec(node.pool, VOLUMES, "metadata", "vol-1")
        await node.command("instance.stop", {"instance_id": "inst-1", "force": True})
        await node.wait_state("inst-1", STOPPED)
        assert rec(node.pool, VOLUMES, "metadata", "vol-1") == before


async def test_same_epoch_held_by_another_node_is_also_a_takeover() -> None:
    async with running_node(shared=True) as node:
        await start(node)
        # A holder record naming another node at this node's own epoch: not ours.
        atomicfile.write_json(node.pool / RETAINED_LAYERS / "holders" / "ws-1.json",
                              {"node_id": "node-b", "epoch": 1}, prefix="node-b")
        assert await node.holder_check().check() == ["inst-1"]
        frame = await node.wait_state("inst-1", FAILED)
        assert "retained layer ws-1 in pool pool-a is held by node node-b" in frame["reason"]
        assert rec(node.pool, RETAINED_LAYERS, "releases", "ws-1")["node_id"] == "node-a"


async def test_unreadable_holder_record_is_retried_not_fenced() -> None:
    async with running_node(shared=True) as node:
        await start(node)
        path = node.pool / VOLUMES / "holders" / "vol-1.json"
        good = path.read_bytes()
        path.write_bytes(b"{not json")  # what a flaky mount might show once
        watch = node.holder_check()
        assert await watch.check() == []
        assert node.manager.get("inst-1").state == RUNNING  # type: ignore[union-attr]
        path.write_bytes(good)
        assert await watch.check() == []


async def test_workspace_takeover_awaits_both_receipts_together() -> None:
    """Spec: taking over a Volume and a writable layer awaits both receipts together.
    Both holder records are node-a's before either receipt exists (one by one, the
    Volume's would wait for the layer's 60 s), and both receipts then open it clean."""
    async with running_node(shared=True, receipt_wait=60) as node:
        pool = node.pool
        layers_b = PoolObjects("pool-a", pool, RETAINED_LAYERS, "node-b")
        await layers_b.open("ws-1", 1, create_capacity=64 * MIB)  # node-b never released
        vols_b = PoolObjects("pool-a", pool, VOLUMES, "node-b")
        await vols_b.open("vol-1", 1, create_capacity=16 * MIB)
        await node.command("instance.create", node.create_args(
            epoch=2, create=False,
            volumes=[{"pool_id": "pool-a", "volume_id": "vol-1", "epoch": 2}]))
        with trio.fail_after(DEADLINE):
            while not (rec(pool, RETAINED_LAYERS, "holders", "ws-1")["node_id"] == "node-a"
                       and rec(pool, VOLUMES, "holders", "vol-1")["node_id"] == "node-a"):
                await trio.sleep(0.02)
        for kind, name in ((RETAINED_LAYERS, "ws-1"), (VOLUMES, "vol-1")):
            atomicfile.write_json(pool / kind / "releases" / f"{name}.json",
                                  {"node_id": "node-b", "epoch": 1}, prefix="node-b")
        await node.wait_state("inst-1", RUNNING)
        for kind, name in ((RETAINED_LAYERS, "ws-1"), (VOLUMES, "vol-1")):
            meta = rec(pool, kind, "metadata", name)
            assert (meta["holder"], meta["epoch"], meta["handoff_clean"]) == ("node-a", 2, True)


async def test_destroy_after_a_takeover_still_writes_the_receipt() -> None:
    """ctrl's destroy (e.g. after telling the node it was isolated) may come before the
    holder check: the release is refused, but the receipt is what the successor waits
    for, and the VMM is gone, so it is written."""
    async with running_node(shared=True) as node:
        await start(node)
        other = PoolObjects("pool-a", node.pool, VOLUMES, "node-b")
        await other.take("vol-1", 2, may_create=False)
        await node.command("instance.destroy", {"instance_id": "inst-1"})
        receipt = rec(node.pool, VOLUMES, "releases", "vol-1")
        assert (receipt["node_id"], receipt["epoch"], receipt["reason"]) == \
            ("node-a", 1, "taken_over")
        assert rec(node.pool, VOLUMES, "metadata", "vol-1")["state"] == "attached"
        assert (await other.open("vol-1", 2)).handoff_clean is True
