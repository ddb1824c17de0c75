"""An object still under its pre-v0.1.0 SHA-256 names is renamed before a Workspace
attaches it (spec/storage-pools-on-nfs.txt, "File names and object IDs": objects not
renamed at startup are renamed before their next attach).  A Workspace's objects are
attached with take / wait_released / finish_open (`Launcher.open_objects`), not `open`,
so this drives those three steps as the launcher does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from kibotos.core.errors import Unavailable
from kibotos.node.storage.objects import RETAINED_LAYERS, PoolObjects
from kibotos.node.storage.pools.dirs import prepare_pool_dirs
from kibotos.node.storage.pools.legacy_names import NamedPoolObjects, digest_name

MIB = 1 << 20
EXT = {"data": ".ext4", "metadata": ".json", "holders": ".json", "releases": ".json",
       "locks": ".lock"}


async def old_named_layer(pool: Path, ref: str) -> None:
    """A layer made, written and released by node-a at epoch 1, then given the old
    names (as a pool written before v0.1.0 has them)."""
    prepare_pool_dirs("pool-a", pool)
    plain = PoolObjects("pool-a", pool, RETAINED_LAYERS, "node-a", receipt_wait=0.3)
    opened = await plain.open(ref, 1, create_capacity=16 * MIB)
    with opened.path.open("r+b") as f:
        f.write(b"payload of " + ref.encode())
    assert plain.release(ref, 1, confirmed_on_disk=True)
    root = pool / RETAINED_LAYERS
    for sub, ext in EXT.items():
        new = root / sub / f"{ref}{ext}"
        if new.exists():
            os.rename(new, root / sub / f"{digest_name(ref)}{ext}")


def names(pool: Path) -> list[str]:
    return sorted(p.name for p in (pool / RETAINED_LAYERS).rglob("*") if p.is_file())


async def attach(objs: PoolObjects, ref: str, epoch: int) -> tuple[Path, bool | None]:
    previous = await objs.take(ref, epoch, may_create=False)
    clean = await objs.wait_released(ref, previous, trio.current_time() + 5)
    opened = await objs.finish_open(ref, epoch, clean)
    assert not opened.created
    return opened.path, clean


async def test_a_workspace_start_renames_an_old_named_layer_before_it_attaches(
        tmp_path: Path) -> None:
    await old_named_layer(tmp_path, "lay-1")
    node_b = NamedPoolObjects("pool-a", tmp_path, RETAINED_LAYERS, "node-b", receipt_wait=5)
    path, clean = await attach(node_b, "lay-1", 2)  # a takeover at a newer epoch
    assert path == tmp_path / RETAINED_LAYERS / "data" / "lay-1.ext4"
    assert path.read_bytes().startswith(b"payload of lay-1")  # the old data, not a new file
    assert clean is True  # node-a's clean release, found under the old metadata name
    assert not any(digest_name("lay-1") in n for n in names(tmp_path))
    assert node_b.holder("lay-1") is not None


async def test_a_start_with_the_same_file_under_two_names_is_refused_retryably(
        tmp_path: Path) -> None:
    await old_named_layer(tmp_path, "lay-1")
    data = tmp_path / RETAINED_LAYERS / "data"
    (data / "lay-1.ext4").write_bytes(b"a restored copy")
    before = names(tmp_path)
    node_b = NamedPoolObjects("pool-a", tmp_path, RETAINED_LAYERS, "node-b", receipt_wait=5)
    with pytest.raises(Unavailable, match="same file under two names") as err:
        await node_b.take("lay-1", 2, may_create=False)
    assert err.value.retryable
    assert names(tmp_path) == before  # no holder record written, nothing renamed
