"""``object.expand`` on real block files: data kept (read back with debugfs on the file),
the resize_inode-removal path, never shrinking, resuming after a failed or killed step,
tool timeouts, and the takeover table."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import trio
from storage_cmd_helpers import (
    GIB,
    MIB,
    Storage,
    dumpe2fs,
    fsck_clean,
    make_pool,
    put_data,
    read_back,
)

from kibotos.core import atomicfile, failpoints
from kibotos.core.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from kibotos.node.instances.commands import storage_handlers
from kibotos.node.storage import expand
from kibotos.node.storage.objects import RETAINED_LAYERS, VOLUMES, PoolObjects

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def pool(tmp_path: Path) -> Path:
    return make_pool(tmp_path / "pool-a", "pool-a")


@pytest.fixture
def fail_at(monkeypatch: pytest.MonkeyPatch):
    def set_(spec: str) -> None:
        monkeypatch.setenv(failpoints.ENV, spec)
        failpoints.reload()
    yield set_
    monkeypatch.delenv(failpoints.ENV, raising=False)
    failpoints.reload()


def layer_meta(pool: Path, kind: str = RETAINED_LAYERS, name: str = "ws-1") -> dict:
    return atomicfile.read_json(pool / kind / "metadata" / f"{name}.json")


async def make_layer(pool: Path, capacity: int, tmp: Path, *, epoch: int = 1,
                     ref: str = "ws-1") -> tuple[Path, dict[str, bytes]]:
    """A retained layer as an Instance leaves it: created, written, released."""
    objs = PoolObjects("pool-a", pool, RETAINED_LAYERS, "node-a")
    opened = await objs.open(ref, epoch, create_capacity=capacity)
    files = put_data(opened.path, tmp / "src")
    objs.release(ref, epoch, confirmed_on_disk=True)
    return opened.path, files


def expand_args(capacity: int, *, epoch: int = 1, kind: str = "retained_layer",
                object_id: str = "ws-1") -> dict:
    return {"kind": kind, "pool_id": "pool-a", "object_id": object_id, "epoch": epoch,
            "capacity_bytes": capacity}


def block_count(image: Path) -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in dumpe2fs(image).splitlines() if ":" in line)
    return int(fields["Block count"]), int(fields["Block size"])


def assert_data(image: Path, files: dict[str, bytes]) -> None:
    for name, content in files.items():
        assert read_back(image, name) == content, name


async def test_a_1gib_layer_with_data_grows_and_keeps_it(pool: Path, tmp_path: Path
                                                          ) -> None:
    image, files = await make_layer(pool, GIB, tmp_path)
    st = Storage("node-a", {"pool-a": pool})
    h = storage_handlers(st.storage)
    assert await h["object.expand"](expand_args(2 * GIB)) == {"capacity_bytes": 2 * GIB}
    assert image.stat().st_size == 2 * GIB
    blocks, size = block_count(image)
    assert blocks * size == 2 * GIB
    assert_data(image, files)
    assert fsck_clean(image)
    meta = layer_meta(pool)
    assert meta["capacity_bytes"] == 2 * GIB
    assert "expansion" not in meta
    assert meta["state"] == "released"
    assert meta["resize_inode"] is True  # within the reserved descriptors: kept
    receipt = atomicfile.read_json(pool / RETAINED_LAYERS / "releases" / "ws-1.json")
    assert receipt["epoch"] == 1
    assert image.stat().st_blocks * 512 < 256 * MIB  # still sparse
    # the same target again: nothing to do, same answer
    assert await h["object.expand"](expand_args(2 * GIB)) == {"capacity_bytes": 2 * GIB}


async def test_beyond_the_reserved_descriptors_resize_inode_is_removed(
        pool: Path, tmp_path: Path) -> None:
    """16 MiB (1 KiB blocks: the reserved descriptors reach 16 GiB) grown to 32 GiB."""
    st = Storage("node-a", {"pool-a": pool})
    h = storage_handlers(st.storage)
    await h["volume.create"]({"volume_id": "vol-1", "pool_id": "pool-a",
                              "capacity_bytes": 16 * MIB, "epoch": 1})
    image = pool / VOLUMES / "data" / "vol-1.ext4"
    files = put_data(image, tmp_path / "src")
    geo = await expand.geometry(image)
    assert "resize_inode" in geo.features
    target = 32 * GIB
    assert geo.needs_resize_inode_removal(target // geo.block_size)
    assert not geo.needs_resize_inode_removal(8 * GIB // geo.block_size)
    result = await h["object.expand"](expand_args(target, kind="volume", object_id="vol-1"))
    assert result == {"capacity_bytes": target}
    after = await expand.geometry(image)
    assert "resize_inode" not in after.features
    assert after.block_count * after.block_size == target
    assert_data(image, files)
    assert fsck_clean(image)
    assert layer_meta(pool, VOLUMES, "vol-1")["resize_inode"] is False


async def test_never_shrinks(pool: Path, tmp_path: Path) -> None:
    await make_layer(pool, 64 * MIB, tmp_path)
    h = storage_handlers(Storage("node-a", {"pool-a": pool}).storage)
    with pytest.raises(InvalidArgument, match="shrink"):
        await h["object.expand"](expand_args(32 * MIB))
    with pytest.raises(InvalidArgument, match="whole number of MiB"):
        await h["object.expand"](expand_args(64 * MIB + 512))
    assert layer_meta(pool)["capacity_bytes"] == 64 * MIB


async def test_missing_object_is_not_found(pool: Path) -> None:
    h = storage_handlers(Storage("node-a", {"pool-a": pool}).storage)
    with pytest.raises(NotFound, match="does not exist"):
        await h["object.expand"](expand_args(128 * MIB))


async def test_a_newer_epoch_refuses(pool: Path, tmp_path: Path) -> None:
    image, _ = await make_layer(pool, 64 * MIB, tmp_path, epoch=5)
    h = storage_handlers(Storage("node-b", {"pool-a": pool}).storage)
    with pytest.raises(FailedPrecondition, match="taken over"):
        await h["object.expand"](expand_args(128 * MIB, epoch=4))
    assert image.stat().st_size == 64 * MIB
    # a newer epoch on another node takes over (the receipt is there: no wait)
    assert await h["object.expand"](expand_args(128 * MIB, epoch=6)) == {
        "capacity_bytes": 128 * MIB}
    holder = atomicfile.read_json(pool / RETAINED_LAYERS / "holders" / "ws-1.json")
    assert (holder["node_id"], holder["epoch"]) == ("node-b", 6)


@pytest.mark.parametrize(("point", "step"), [
    ("node.expand.after-check", "check"),
    ("node.expand.after-tune2fs", "remove_resize_inode"),
    ("node.expand.after-recheck", "recheck"),
    ("node.expand.after-grow-file", "grow_file"),
    ("node.expand.after-resize", "resize"),
])
async def test_a_failed_step_is_resumed_by_the_same_target(
        pool: Path, tmp_path: Path, fail_at, point: str, step: str) -> None:
    st = Storage("node-a", {"pool-a": pool})
    h = storage_handlers(st.storage)
    await h["volume.create"]({"volume_id": "vol-1", "pool_id": "pool-a",
                              "capacity_bytes": 16 * MIB, "epoch": 1})
    image = pool / VOLUMES / "data" / "vol-1.ext4"
    files = put_data(image, tmp_path / "src")
    target = 32 * GIB
    args = expand_args(target, kind="volume", object_id="vol-1")
    fail_at(f"{point}=error")
    with pytest.raises(FailedPrecondition, match=f"step {step}") as info:
        await h["object.expand"](args)
    assert info.value.details["step"] == step
    pending = layer_meta(pool, VOLUMES, "vol-1")
    assert pending["expansion"]["target_bytes"] == target
    assert pending["expansion"]["step"] == step
    assert "failpoint" in pending["expansion"]["last_error"]
    assert pending["capacity_bytes"] == 16 * MIB
    assert pending["state"] == "released"  # released even after a failure
    # a smaller target than the unfinished one is refused
    with pytest.raises(InvalidArgument, match="unfinished expansion"):
        await h["object.expand"](expand_args(20 * GIB, kind="volume", object_id="vol-1"))
    fail_at("")
    assert await h["object.expand"](args) == {"capacity_bytes": target}
    meta = layer_meta(pool, VOLUMES, "vol-1")
    assert "expansion" not in meta
    assert meta["capacity_bytes"] == target
    blocks, size = block_count(image)
    assert blocks * size == target
    assert_data(image, files)
    assert fsck_clean(image)


async def test_a_tool_over_its_time_is_killed_and_the_rerun_finishes(
        pool: Path, tmp_path: Path) -> None:
    image, files = await make_layer(pool, 64 * MIB, tmp_path)
    slow = Storage("node-a", {"pool-a": pool}, tool_timeout=0)
    with pytest.raises(DeadlineExceeded, match="did not finish"):
        await storage_handlers(slow.storage)["object.expand"](expand_args(256 * MIB))
    assert layer_meta(pool)["expansion"]["target_bytes"] == 256 * MIB
    whole = Storage("node-a", {"pool-a": pool}, total_timeout=0)
    with pytest.raises(DeadlineExceeded):
        await storage_handlers(whole.storage)["object.expand"](expand_args(256 * MIB))
    ok = Storage("node-a", {"pool-a": pool})
    await storage_handlers(ok.storage)["object.expand"](expand_args(256 * MIB))
    assert image.stat().st_size == 256 * MIB
    assert_data(image, files)


KILLED = textwrap.dedent("""
    import sys, trio
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from storage_cmd_helpers import Storage
    from kibotos.node.instances.commands import storage_handlers
    st = Storage("node-a", {"pool-a": Path(sys.argv[1])})
    trio.run(storage_handlers(st.storage)["object.expand"], {
        "kind": "retained_layer", "pool_id": "pool-a", "object_id": "ws-1", "epoch": 1,
        "capacity_bytes": int(sys.argv[3])})
""")


@pytest.mark.parametrize("point", ["node.expand.after-tune2fs", "node.expand.after-grow-file",
                                   "node.expand.after-resize"])
async def test_a_node_killed_mid_expansion_is_resumed(pool: Path, tmp_path: Path,
                                                      point: str) -> None:
    """The node process dies (SIGKILL) between two steps; the next node process (here:
    this test) expands to the same target and the data is there."""
    objs = PoolObjects("pool-a", pool, RETAINED_LAYERS, "node-a")
    opened = await objs.open("ws-1", 1, create_capacity=16 * MIB)
    files = put_data(opened.path, tmp_path / "src")
    objs.release("ws-1", 1, confirmed_on_disk=True)
    target = 32 * GIB
    env = {**os.environ, failpoints.ENV: f"{point}=kill"}
    with trio.fail_after(300):
        proc = await trio.run_process(
            [sys.executable, "-c", KILLED, str(pool), str(Path(__file__).parent), str(target)],
            env=env, cwd=REPO, capture_stdout=True, capture_stderr=True, check=False)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    meta = layer_meta(pool)
    assert meta["state"] == "attached"  # died holding it
    assert meta["expansion"]["target_bytes"] == target
    h = storage_handlers(Storage("node-a", {"pool-a": pool}).storage)
    assert await h["object.expand"](expand_args(target)) == {"capacity_bytes": target}
    blocks, size = block_count(opened.path)
    assert blocks * size == target
    assert_data(opened.path, files)
    assert fsck_clean(opened.path)
    assert layer_meta(pool)["state"] == "released"


def test_geometry_from_dumpe2fs_text() -> None:
    text = ("Filesystem features:      has_journal resize_inode 64bit flex_bg\n"
            "Block count:              262144\nFirst block:              0\n"
            "Block size:               4096\nGroup descriptor size:    64\n"
            "Reserved GDT blocks:      127\nBlocks per group:         32768\n")
    geo = expand.parse_geometry(text)
    # 8 groups in 1 descriptor block + 127 reserved, 64 descriptors per block
    assert geo.max_blocks_in_place() == 128 * 64 * 32768
    assert geo.needs_resize_inode_removal(128 * 64 * 32768 + 1)
    assert not geo.needs_resize_inode_removal(128 * 64 * 32768)
    meta_bg = expand.parse_geometry(text.replace("flex_bg", "flex_bg meta_bg"))
    assert meta_bg.max_blocks_in_place() is None
    with pytest.raises(FailedPrecondition, match="Block size"):
        expand.parse_geometry("Block count: 1\n")


async def test_a_takeover_during_an_expansion_stops_it(pool: Path, tmp_path: Path) -> None:
    """A newer epoch appears while a tool runs (here an e2fsck that would take two
    minutes): the holder check kills it, the receipt is written for the new holder, and
    the command fails as taken over; the block file was not grown."""
    image, files = await make_layer(pool, 64 * MIB, tmp_path)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "e2fsck").write_text("#!/bin/sh\nexec sleep 120\n")
    (fake / "e2fsck").chmod(0o755)
    st = Storage("node-a", {"pool-a": pool}, tool_path=f"{fake}:{expand.TOOL_PATH}",
                 holder_check=0.05)
    h = storage_handlers(st.storage)
    handoff: list[bool | None] = []

    async def take_over() -> None:
        while (layer_meta(pool).get("expansion") or {}).get("step") != "check":
            await trio.sleep(0.02)
        other = PoolObjects("pool-a", pool, RETAINED_LAYERS, "node-b", receipt_wait=60.0)
        handoff.append((await other.open("ws-1", 2)).handoff_clean)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take_over)
            with pytest.raises(FailedPrecondition, match="taken over") as info:
                await h["object.expand"](expand_args(256 * MIB))
    assert info.value.details["reason"] == "use_right_taken_over"
    assert handoff == [True]  # node-a's receipt came: a clean handoff
    receipt = atomicfile.read_json(pool / RETAINED_LAYERS / "releases" / "ws-1.json")
    assert (receipt["node_id"], receipt["epoch"]) == ("node-a", 1)
    assert receipt["successor"] == {"node_id": "node-b", "epoch": 2}
    assert image.stat().st_size == 64 * MIB
    assert_data(image, files)
    meta = layer_meta(pool)
    assert (meta["holder"], meta["epoch"]) == ("node-b", 2)
