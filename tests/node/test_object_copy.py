"""``object.copy``: a block file copied sparsely into another pool with its metadata,
idempotent, refused when the target holds another object or a pool is missing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
from storage_cmd_helpers import MIB, Storage, fsck_clean, make_pool, put_data, read_back, tree

from kibotos.core import atomicfile, failpoints
from kibotos.core.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kibotos.node.instances.commands import storage_handlers
from kibotos.node.storage.objects import RETAINED_LAYERS, VOLUMES, PoolObjects
from kibotos.transfer_archive import data_ranges


@pytest.fixture
def pools(tmp_path: Path) -> dict[str, Path]:
    return {"pool-a": make_pool(tmp_path / "pool-a", "pool-a"),
            "pool-b": make_pool(tmp_path / "pool-b", "pool-b")}


def copy_args(**kw):
    return {"kind": "volume", "object_id": "vol-1", "from_pool_id": "pool-a",
            "to_pool_id": "pool-b", "epoch": 2, **kw}


async def made_volume(h, pools, tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    await h["volume.create"]({"volume_id": "vol-1", "pool_id": "pool-a",
                              "capacity_bytes": 256 * MIB, "epoch": 2})
    src = pools["pool-a"] / VOLUMES / "data" / "vol-1.ext4"
    return src, put_data(src, tmp_path / "src")


async def test_copy_keeps_data_and_holes_and_records(pools, tmp_path: Path) -> None:
    st = Storage("node-a", pools)
    h = storage_handlers(st.storage)
    src, files = await made_volume(h, pools, tmp_path)
    assert await h["object.copy"](copy_args()) == {"copied": True}
    dst = pools["pool-b"] / VOLUMES / "data" / "vol-1.ext4"
    assert dst.stat().st_size == src.stat().st_size
    assert dst.stat().st_blocks <= src.stat().st_blocks  # sparse: no more than the source
    assert dst.stat().st_blocks * 512 < 64 * MIB
    for name, content in files.items():
        assert read_back(dst, name) == content
    assert fsck_clean(dst)
    meta = atomicfile.read_json(pools["pool-b"] / VOLUMES / "metadata" / "vol-1.json")
    assert meta["pool_id"] == "pool-b"
    assert meta["capacity_bytes"] == 256 * MIB
    assert meta["copied_from"]["pool_id"] == "pool-a"
    assert meta["copied_from"]["epoch"] == 2
    assert meta["created_with"] == {"capacity_bytes": 256 * MIB, "epoch": 2}
    assert meta["state"] == "released"
    receipt = atomicfile.read_json(pools["pool-b"] / VOLUMES / "releases" / "vol-1.json")
    assert (receipt["node_id"], receipt["epoch"]) == ("node-a", 2)
    # the source is released too, and stays until ctrl deletes it
    src_meta = atomicfile.read_json(pools["pool-a"] / VOLUMES / "metadata" / "vol-1.json")
    assert src_meta["state"] == "released"
    assert src.exists()
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(".")]
    assert {("volumes", "pool-a", "vol-1"), ("volumes", "pool-b", "vol-1")} <= st.retained
    # again: the same copy, not made again
    inode = dst.stat().st_ino
    assert await h["object.copy"](copy_args()) == {"copied": True}
    assert dst.stat().st_ino == inode
    # another node opens the copy at a newer epoch without waiting
    other = PoolObjects("pool-b", pools["pool-b"], VOLUMES, "node-b", receipt_wait=30.0)
    assert (await other.open("vol-1", 3)).handoff_clean is True


async def test_copy_of_a_retained_layer(pools, tmp_path: Path) -> None:
    objs = PoolObjects("pool-a", pools["pool-a"], RETAINED_LAYERS, "node-a")
    opened = await objs.open("ws-1", 1, create_capacity=64 * MIB,
                             lower={"template": "tiny"})
    files = put_data(opened.path, tmp_path / "src")
    objs.release("ws-1", 1, confirmed_on_disk=True)
    h = storage_handlers(Storage("node-a", pools).storage)
    await h["object.copy"](copy_args(kind="retained_layer", object_id="ws-1", epoch=2))
    dst = pools["pool-b"] / RETAINED_LAYERS / "data" / "ws-1.ext4"
    for name, content in files.items():
        assert read_back(dst, name) == content
    meta = atomicfile.read_json(pools["pool-b"] / RETAINED_LAYERS / "metadata" / "ws-1.json")
    assert meta["lower"] == {"template": "tiny"}


async def test_an_interrupted_copy_is_made_again(pools, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    h = storage_handlers(Storage("node-a", pools).storage)
    _, files = await made_volume(h, pools, tmp_path)
    monkeypatch.setenv(failpoints.ENV, "node.copy.before-rename=error")
    failpoints.reload()
    try:
        with pytest.raises(OSError, match="failpoint"):
            await h["object.copy"](copy_args())
    finally:
        monkeypatch.delenv(failpoints.ENV)
        failpoints.reload()
    dst_dir = pools["pool-b"] / VOLUMES / "data"
    assert list(dst_dir.iterdir()) == []  # the temporary file went
    assert await h["object.copy"](copy_args()) == {"copied": True}
    for name, content in files.items():
        assert read_back(dst_dir / "vol-1.ext4", name) == content


async def test_refusals(pools, tmp_path: Path) -> None:
    h = storage_handlers(Storage("node-a", pools).storage)
    with pytest.raises(NotFound):
        await h["object.copy"](copy_args())
    with pytest.raises(InvalidArgument, match="both"):
        await h["object.copy"](copy_args(to_pool_id="pool-a"))
    with pytest.raises(FailedPrecondition, match="not configured"):
        await h["object.copy"](copy_args(to_pool_id="pool-c"))
    await made_volume(h, pools, tmp_path)
    # the target pool holds another Volume under that ID
    await h["volume.create"]({"volume_id": "vol-1", "pool_id": "pool-b",
                              "capacity_bytes": 64 * MIB, "epoch": 1})
    before = tree(pools["pool-b"])
    with pytest.raises(AlreadyExists, match="not a copy"):
        await h["object.copy"](copy_args())
    assert tree(pools["pool-b"]) == before
    # a newer epoch holds the source
    await h["volume.delete"]({"volume_id": "vol-1", "pool_id": "pool-b", "epoch": 1})
    await PoolObjects("pool-a", pools["pool-a"], VOLUMES, "node-b").open("vol-1", 9)
    with pytest.raises(FailedPrecondition, match="taken over"):
        await h["object.copy"](copy_args(epoch=3))
    assert list((pools["pool-b"] / VOLUMES / "data").iterdir()) == []


def test_data_ranges_follow_the_holes(tmp_path: Path) -> None:
    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.truncate(64 * MIB)
        f.seek(8 * MIB)
        f.write(b"x" * MIB)
        f.seek(40 * MIB)
        f.write(b"y" * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        ranges = data_ranges(fd, 64 * MIB)
    finally:
        os.close(fd)
    covered = sum(length for _, length in ranges)
    assert covered < 4 * MIB  # only the written pieces (filesystem granularity aside)
    assert any(start <= 8 * MIB < start + length for start, length in ranges)
    assert any(start <= 40 * MIB < start + length for start, length in ranges)


async def test_a_takeover_of_the_source_during_a_copy_stops_it(
        pools, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = Storage("node-a", pools, holder_check=0.05)
    h = storage_handlers(st.storage)
    await made_volume(h, pools, tmp_path)
    monkeypatch.setenv(failpoints.ENV, "node.copy.before-rename=sleep:1")
    failpoints.reload()
    handoff: list[bool | None] = []

    async def take_over() -> None:
        meta = pools["pool-a"] / VOLUMES / "metadata" / "vol-1.json"
        while atomicfile.read_json(meta).get("state") != "attached":
            await trio.sleep(0.01)
        other = PoolObjects("pool-a", pools["pool-a"], VOLUMES, "node-b", receipt_wait=60.0)
        handoff.append((await other.open("vol-1", 3)).handoff_clean)

    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(take_over)
                with pytest.raises(FailedPrecondition, match="taken over"):
                    await h["object.copy"](copy_args())
    finally:
        monkeypatch.delenv(failpoints.ENV)
        failpoints.reload()
    assert handoff == [True]
    receipt = atomicfile.read_json(pools["pool-a"] / VOLUMES / "releases" / "vol-1.json")
    assert receipt["successor"] == {"node_id": "node-b", "epoch": 3}
    assert not (pools["pool-b"] / VOLUMES / "metadata" / "vol-1.json").exists()
