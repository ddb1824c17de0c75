"""Retained layers and Volumes in a pool: the records, and the spec's takeover table
("Epochs and takeover") on real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.node.storage.objects import (
    RETAINED_LAYERS,
    VOLUMES,
    Holder,
    PoolObjects,
    UseRightTakenOver,
)
from kibotos.node.storage.pools.dirs import prepare_pool_dirs

MIB = 1 << 20


def layers(pool: Path, node: str = "node-a", wait: float = 0.3) -> PoolObjects:
    prepare_pool_dirs("pool-a", pool)  # the layout the node's start makes
    return PoolObjects("pool-a", pool, RETAINED_LAYERS, node, receipt_wait=wait)


def rec(pool: Path, sub: str, name: str = "ws-1") -> dict:
    return atomicfile.read_json(pool / "retained-layers" / sub / f"{name}.json")


def files(pool: Path) -> list[str]:
    return sorted(str(p.relative_to(pool)) for p in pool.rglob("*") if p.is_file())


async def test_create_then_retry_then_release(tmp_path: Path) -> None:
    objs = layers(tmp_path)
    opened = await objs.open("ws-1", 3, create_capacity=16 * MIB,
                             lower={"template": "t", "image_digest": "sha256:ab"})
    assert opened.created
    assert opened.handoff_clean is None
    assert opened.path == tmp_path / "retained-layers" / "data" / "ws-1.ext4"
    assert opened.path.stat().st_size == 16 * MIB
    assert rec(tmp_path, "holders") | {"at": None} == {"node_id": "node-a", "epoch": 3,
                                                       "at": None}
    meta = rec(tmp_path, "metadata")
    assert (meta["id"], meta["kind"], meta["pool_id"], meta["capacity_bytes"],
            meta["state"], meta["epoch"]) == ("ws-1", "retained-layers", "pool-a", 16 * MIB,
                                              "attached", 3)
    assert meta["lower"] == {"template": "t", "image_digest": "sha256:ab"}
    # No temporary file is left; every record is a whole JSON object.
    assert not [f for f in files(tmp_path) if "/." in f]

    again = await objs.open("ws-1", 3, create_capacity=16 * MIB)  # a retry: same epoch
    assert not again.created
    assert again.handoff_clean is None

    assert objs.release("ws-1", 3, confirmed_on_disk=True)
    meta = rec(tmp_path, "metadata")
    assert (meta["state"], meta["released_cleanly"], meta["confirmed_on_disk"]) == \
        ("released", True, True)
    assert rec(tmp_path, "releases")["epoch"] == 3
    assert rec(tmp_path, "holders")["epoch"] == 3  # the holder record stays
    assert objs.held_by_me() == ["ws-1"]


async def test_newer_epoch_refuses_and_writes_nothing(tmp_path: Path) -> None:
    b = layers(tmp_path, "node-b")
    await b.open("ws-1", 5, create_capacity=8 * MIB)
    before = {f: (tmp_path / f).read_bytes() for f in files(tmp_path)}
    a = layers(tmp_path)
    with pytest.raises(UseRightTakenOver, match="use right was taken over") as caught:
        await a.open("ws-1", 4)
    assert caught.value.details["reason"] == "use_right_taken_over"
    assert not caught.value.retryable
    with pytest.raises(UseRightTakenOver, match="already holds epoch 5"):
        await a.open("ws-1", 5)  # the same epoch belongs to node-b
    assert {f: (tmp_path / f).read_bytes() for f in files(tmp_path)
            if not f.endswith(".lock")} == {f: v for f, v in before.items()
                                            if not f.endswith(".lock")}
    # A release or delete by the old holder changes nothing either.
    assert not a.release("ws-1", 4, confirmed_on_disk=True)
    with pytest.raises(UseRightTakenOver):
        a.delete("ws-1", 4)
    assert (tmp_path / "retained-layers" / "data" / "ws-1.ext4").is_file()


async def test_takeover_after_a_clean_release_does_not_wait(tmp_path: Path) -> None:
    b = layers(tmp_path, "node-b", wait=60)
    await b.open("ws-1", 1, create_capacity=8 * MIB)
    assert b.release("ws-1", 1, confirmed_on_disk=True)
    a = layers(tmp_path, wait=60)
    with trio.fail_after(30):  # would take the whole receipt wait if it waited
        opened = await a.open("ws-1", 2)
    assert opened.handoff_clean is True
    assert rec(tmp_path, "holders")["node_id"] == "node-a"
    meta = rec(tmp_path, "metadata")
    assert (meta["holder"], meta["epoch"], meta["released_cleanly"]) == ("node-a", 2, True)


async def test_takeover_without_a_receipt_records_an_unclean_handoff(tmp_path: Path) -> None:
    b = layers(tmp_path, "node-b")
    await b.open("ws-1", 1, create_capacity=8 * MIB)  # node-b never releases (isolated)
    a = layers(tmp_path, wait=0.3)
    opened = await a.open("ws-1", 2)
    assert opened.handoff_clean is False
    assert rec(tmp_path, "metadata")["released_cleanly"] is False
    assert rec(tmp_path, "holders") | {"at": None} == {"node_id": "node-a", "epoch": 2,
                                                       "at": None}


async def test_takeover_waits_for_the_receipt(tmp_path: Path) -> None:
    b = layers(tmp_path, "node-b")
    await b.open("ws-1", 1, create_capacity=8 * MIB)
    a = layers(tmp_path, wait=60)
    result = {}

    async def take() -> None:
        result["opened"] = await a.open("ws-1", 2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take)
        # The holder record changes first (node-a's, epoch 2); node-b sees the newer
        # epoch, stops writing and writes its receipt for epoch 1.
        with trio.fail_after(30):
            while rec(tmp_path, "holders")["node_id"] != "node-a":
                await trio.sleep(0.02)
        atomicfile.write_json(tmp_path / "retained-layers" / "releases" / "ws-1.json",
                              {"node_id": "node-b", "epoch": 1}, prefix="node-b")
    assert result["opened"].handoff_clean is True


async def test_missing_object_without_create_writes_no_holder(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="does not exist"):
        await layers(tmp_path).open("ws-9", 1)
    assert not (tmp_path / "retained-layers" / "holders" / "ws-9.json").exists()
    vols = PoolObjects("pool-a", tmp_path, VOLUMES, "node-a")
    with pytest.raises(FailedPrecondition, match="volume vol-1 in pool pool-a does not"):
        await vols.open("vol-1", 1)


@pytest.mark.parametrize("bad", ["../x", "A", "x" * 33, "-x", "a/b", "a.b", ""])
async def test_bad_ids_write_nothing(tmp_path: Path, bad: str) -> None:
    objs = layers(tmp_path)
    with pytest.raises(InvalidArgument):
        await objs.open(bad, 1, create_capacity=8 * MIB)
    with pytest.raises(InvalidArgument):
        objs.delete(bad, 1)
    assert files(tmp_path) == []


async def test_metadata_naming_another_object_is_refused(tmp_path: Path) -> None:
    objs = layers(tmp_path)
    await objs.open("ws-1", 1, create_capacity=8 * MIB)
    path = tmp_path / "retained-layers" / "metadata" / "ws-1.json"
    meta = atomicfile.read_json(path)
    atomicfile.write_json(path, {**meta, "id": "ws-2"})
    with pytest.raises(FailedPrecondition, match="refusing to use it"):
        await objs.open("ws-1", 1)


async def test_delete_removes_everything_and_is_idempotent(tmp_path: Path) -> None:
    objs = layers(tmp_path)
    await objs.open("ws-1", 2, create_capacity=8 * MIB)
    objs.release("ws-1", 2, confirmed_on_disk=False)
    assert objs.delete("ws-1", 2) is True
    assert files(tmp_path) == []
    assert objs.delete("ws-1", 2) is False
    assert objs.held_by_me() == []


def test_a_failed_mkfs_leaves_no_file(tmp_path: Path) -> None:
    objs = layers(tmp_path)
    with pytest.raises(InvalidArgument, match="whole number of MiB"):
        objs._create("ws-1", 5, None)
    assert list(os.listdir(tmp_path / "retained-layers" / "data")) == []


async def test_block_file_is_handed_to_the_vmm_identity(tmp_path: Path) -> None:
    """root:kibotos-vmm 0660 (the VMM opens it for writing), inside data/ 0710."""
    import grp
    import stat

    opened = await layers(tmp_path).open("ws-1", 1, create_capacity=16 * MIB)
    st = opened.path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert stat.S_IMODE(opened.path.parent.stat().st_mode) == 0o710
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (0, grp.getgrnam("kibotos-vmm").gr_gid)


async def test_unavailable_pool_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    from kibotos.core.errors import Unavailable

    prepare_pool_dirs("pool-a", tmp_path)
    reason: list[str | None] = ["storage pool marker is missing"]
    objs = PoolObjects("pool-a", tmp_path, RETAINED_LAYERS, "node-a",
                       unavailable=lambda: reason[0])
    before = files(tmp_path)
    with pytest.raises(Unavailable, match="storage pool is unavailable: pool pool-a: "
                                          "storage pool marker is missing") as info:
        await objs.open("ws-1", 1, create_capacity=16 * MIB)
    assert info.value.retryable
    with pytest.raises(Unavailable):
        objs.delete("ws-1", 1)
    assert files(tmp_path) == before
    reason[0] = None  # the monitor saw it come back
    assert (await objs.open("ws-1", 1, create_capacity=16 * MIB)).created


async def test_a_pool_without_its_layout_is_not_recreated(tmp_path: Path) -> None:
    """The directories come from the node's start; gone (unmounted) means unavailable,
    not a fresh tree on whatever disk is there now."""
    from kibotos.core.errors import Unavailable

    objs = PoolObjects("pool-a", tmp_path, RETAINED_LAYERS, "node-a")
    with pytest.raises(Unavailable, match="pool layout the node prepared at start is gone"):
        await objs.open("ws-1", 1, create_capacity=16 * MIB)
    assert os.listdir(tmp_path) == []


async def test_reopen_at_a_released_epoch_drops_the_stale_receipt(tmp_path: Path) -> None:
    """A receipt says its holder stopped writing.  Reopened at the same epoch, that is
    no longer true: a successor must wait again, not open at once."""
    a = layers(tmp_path)
    await a.open("ws-1", 1, create_capacity=8 * MIB)
    assert a.release("ws-1", 1, confirmed_on_disk=True)
    assert rec(tmp_path, "releases")["epoch"] == 1
    await a.open("ws-1", 1)  # the same node starts it again at the same epoch
    assert not (tmp_path / "retained-layers" / "releases" / "ws-1.json").exists()
    b = layers(tmp_path, "node-b", wait=0.3)
    assert (await b.open("ws-1", 2)).handoff_clean is False  # node-a never stopped


async def test_takeover_of_this_nodes_own_older_epoch(tmp_path: Path) -> None:
    """Takeover row, 'epoch older than the command's': also when the record is this
    node's own (ctrl granted it again after an isolate): holder record first, then open;
    its own earlier release counts as the receipt."""
    a = layers(tmp_path, wait=60)
    await a.open("ws-1", 1, create_capacity=8 * MIB)
    assert a.release("ws-1", 1, confirmed_on_disk=True)
    opened = await a.open("ws-1", 2)
    assert opened.handoff_clean is True
    assert rec(tmp_path, "holders")["epoch"] == 2
    assert rec(tmp_path, "metadata")["epoch"] == 2


async def test_retry_of_an_interrupted_takeover_still_waits(tmp_path: Path) -> None:
    """The node died after writing its holder record (epoch 2) but before opening: the
    retry at epoch 2 is 'same epoch, this node', yet the metadata still names node-b's
    epoch 1 as attached, so the receipt wait is still owed."""
    b = layers(tmp_path, "node-b")
    await b.open("ws-1", 1, create_capacity=8 * MIB)  # node-b never releases
    a = layers(tmp_path, wait=0.3)
    assert await a.take("ws-1", 2, may_create=False) == Holder("node-b", 1)
    # ... crash here; the retry:
    assert (await a.open("ws-1", 2)).handoff_clean is False
    assert rec(tmp_path, "metadata")["released_cleanly"] is False


async def test_fence_writes_the_receipt_and_leaves_the_metadata(tmp_path: Path) -> None:
    a = layers(tmp_path)
    await a.open("ws-1", 1, create_capacity=8 * MIB)
    assert a.taken_over("ws-1", 1) is None
    b = layers(tmp_path, "node-b", wait=60)
    await b.take("ws-1", 2, may_create=False)
    successor = a.taken_over("ws-1", 1)
    assert successor == Holder("node-b", 2)
    meta = rec(tmp_path, "metadata")
    assert a.fence("ws-1", 1, successor=successor)
    assert rec(tmp_path, "metadata") == meta
    receipt = rec(tmp_path, "releases")
    assert (receipt["node_id"], receipt["epoch"], receipt["reason"]) == ("node-a", 1,
                                                                         "taken_over")
    assert a.fence("ws-1", 1, successor=successor)  # idempotent
    assert (await b.open("ws-1", 2)).handoff_clean is True
    # An old holder's late receipt never replaces a newer one.
    assert b.release("ws-1", 2, confirmed_on_disk=True)
    assert not a.fence("ws-1", 1, successor=successor)
    assert rec(tmp_path, "releases")["node_id"] == "node-b"
