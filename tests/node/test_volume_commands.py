"""``volume.create`` / ``volume.delete`` on the node, through the session handlers:
ID checks before anything is written, the block file (sparse ext4 of the capacity), its
records (metadata, holder, receipt), idempotency, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from storage_cmd_helpers import MIB, Storage, dumpe2fs, make_pool, tree

from kibotos.core import atomicfile
from kibotos.core.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from kibotos.node.instances.commands import storage_handlers
from kibotos.node.storage.objects import VOLUMES, PoolObjects


@pytest.fixture
def pool(tmp_path: Path) -> Path:
    return make_pool(tmp_path / "pool-a", "pool-a")


def handlers(pool: Path, node_id: str = "node-a") -> tuple[Storage, dict]:
    st = Storage(node_id, {"pool-a": pool})
    return st, storage_handlers(st.storage)


def create_args(**kw):
    return {"volume_id": "vol-1", "pool_id": "pool-a", "capacity_bytes": 64 * MIB,
            "epoch": 1, **kw}


async def test_create_makes_a_sparse_ext4_file_and_releases_it(pool: Path) -> None:
    st, h = handlers(pool)
    assert await h["volume.create"](create_args()) == {"created": True}
    data = pool / "volumes" / "data" / "vol-1.ext4"
    assert data.stat().st_size == 64 * MIB
    assert data.stat().st_blocks * 512 < 16 * MIB  # truncate + mkfs, no preallocation
    assert "Block count:" in dumpe2fs(data)
    meta = atomicfile.read_json(pool / "volumes" / "metadata" / "vol-1.json")
    assert meta["id"] == "vol-1"
    assert meta["kind"] == VOLUMES
    assert meta["pool_id"] == "pool-a"
    assert meta["capacity_bytes"] == 64 * MIB
    assert meta["created_with"] == {"capacity_bytes": 64 * MIB, "epoch": 1}
    assert meta["state"] == "released"
    assert meta["released_cleanly"] is True
    assert atomicfile.read_json(pool / "volumes" / "holders" / "vol-1.json")["epoch"] == 1
    receipt = atomicfile.read_json(pool / "volumes" / "releases" / "vol-1.json")
    assert (receipt["node_id"], receipt["epoch"]) == ("node-a", 1)
    assert ("volumes", "pool-a", "vol-1") in st.retained  # private pool: counted as held
    assert not [p for p in (pool / "volumes" / "data").iterdir() if p.name.startswith(".")]


async def test_create_is_idempotent_and_refuses_other_args(pool: Path) -> None:
    _, h = handlers(pool)
    await h["volume.create"](create_args())
    data = pool / "volumes" / "data" / "vol-1.ext4"
    inode = data.stat().st_ino
    assert await h["volume.create"](create_args()) == {"created": True}
    assert data.stat().st_ino == inode  # not made again
    with pytest.raises(AlreadyExists, match="other arguments"):
        await h["volume.create"](create_args(capacity_bytes=128 * MIB))
    with pytest.raises(AlreadyExists):
        await h["volume.create"](create_args(epoch=2))


@pytest.mark.parametrize("bad", ["..", "a/b", "/etc", "Vol-1", "v" * 33, "-vol", "",
                                 "vol 1", "vol.1"])
async def test_bad_ids_are_refused_before_anything_is_written(pool: Path, bad: str) -> None:
    _, h = handlers(pool)
    before = tree(pool)
    with pytest.raises(InvalidArgument, match="volume_id"):
        await h["volume.create"](create_args(volume_id=bad))
    with pytest.raises(InvalidArgument, match="volume_id"):
        await h["volume.delete"]({"volume_id": bad, "pool_id": "pool-a", "epoch": 1})
    with pytest.raises(InvalidArgument, match="object_id"):
        await h["object.expand"]({"kind": "volume", "pool_id": "pool-a", "object_id": bad,
                                  "epoch": 1, "capacity_bytes": 128 * MIB})
    with pytest.raises(InvalidArgument, match="object_id"):
        await h["object.copy"]({"kind": "volume", "object_id": bad, "from_pool_id": "pool-a",
                                "to_pool_id": "pool-b", "epoch": 1})
    assert tree(pool) == before


async def test_32_byte_id_is_fine(pool: Path) -> None:
    _, h = handlers(pool)
    assert await h["volume.create"](create_args(volume_id="v" * 32)) == {"created": True}


@pytest.mark.parametrize(("field", "value", "match"), [
    ("capacity_bytes", 64 * MIB + 1, "whole number of MiB"),
    ("capacity_bytes", 0, "must be at least 1 MiB"),
    ("epoch", -1, "greater than or equal"),
    ("pool_id", "Pool/A", "pool ID"),
    ("extra", 1, "unknown field"),
])
async def test_bad_args_are_refused(pool: Path, field: str, value: object, match: str
                                    ) -> None:
    _, h = handlers(pool)
    before = tree(pool)
    with pytest.raises(InvalidArgument, match=match):
        await h["volume.create"](create_args(**{field: value}))
    assert tree(pool) == before


async def test_unconfigured_pool_is_refused(pool: Path) -> None:
    _, h = handlers(pool)
    with pytest.raises(FailedPrecondition, match="not configured"):
        await h["volume.create"](create_args(pool_id="pool-b"))


async def test_another_node_opens_it_at_a_newer_epoch_without_waiting(pool: Path) -> None:
    _, h = handlers(pool)
    await h["volume.create"](create_args(epoch=3))
    other = PoolObjects("pool-a", pool, VOLUMES, "node-b", receipt_wait=30.0)
    opened = await other.open("vol-1", 4)
    assert opened.handoff_clean is True  # the create's receipt: no 30 s wait
    # and the creating node itself opens it at the create's epoch directly
    same = PoolObjects("pool-a", pool, VOLUMES, "node-a")
    with pytest.raises(FailedPrecondition, match="taken over"):
        await same.open("vol-1", 3)  # node-b holds epoch 4 now


async def test_create_refused_when_a_newer_epoch_holds_the_id(pool: Path) -> None:
    other = PoolObjects("pool-a", pool, VOLUMES, "node-b")
    await other.open("vol-1", 5, create_capacity=64 * MIB)
    _, h = handlers(pool)
    with pytest.raises(AlreadyExists):
        await h["volume.create"](create_args(epoch=6, capacity_bytes=32 * MIB))


async def test_delete(pool: Path) -> None:
    st, h = handlers(pool)
    await h["volume.create"](create_args(epoch=2))
    with pytest.raises(FailedPrecondition, match="taken over"):
        await h["volume.delete"]({"volume_id": "vol-1", "pool_id": "pool-a", "epoch": 1})
    assert (pool / "volumes" / "data" / "vol-1.ext4").exists()
    assert await h["volume.delete"]({"volume_id": "vol-1", "pool_id": "pool-a",
                                     "epoch": 2}) == {"deleted": True}
    for sub in ("data", "metadata", "holders", "releases"):
        assert not list((pool / "volumes" / sub).iterdir()), sub
    assert ("volumes", "pool-a", "vol-1") not in st.retained
    # absent: still deleted
    assert await h["volume.delete"]({"volume_id": "vol-1", "pool_id": "pool-a",
                                     "epoch": 2}) == {"deleted": True}


async def test_create_after_an_interrupted_create_finishes_it(pool: Path) -> None:
    """A create that stopped after the block file was made (metadata state created, no
    created_with, no receipt) is finished by the retry with the same arguments."""
    objs = PoolObjects("pool-a", pool, VOLUMES, "node-a")
    await objs.open("vol-1", 1, create_capacity=64 * MIB)  # attached, never released
    _, h = handlers(pool)
    assert await h["volume.create"](create_args()) == {"created": True}
    meta = atomicfile.read_json(pool / "volumes" / "metadata" / "vol-1.json")
    assert meta["state"] == "released"
    assert meta["created_with"]["epoch"] == 1
    assert (pool / "volumes" / "releases" / "vol-1.json").exists()
