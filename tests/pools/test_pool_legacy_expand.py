"""Commands that read an object by name (expand, copy) rename the SHA-256 names of a
version before v0.1.0 first, as attach, release and delete do: without that, a Volume
still under its old names would be ``not_found`` to them."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from kibotos.core import atomicfile
from kibotos.node.storage.objects import VOLUMES
from kibotos.node.storage.pools import legacy_names as ln
from kibotos.node.storage.pools.dirs import prepare_pool_dirs
from kibotos.node.storage.pools.marker import init_pool
from kibotos.node.storage.volume_ops import NodeStorage

MIB = 1 << 20


def old_ext4_volume(pool: Path, volume_id: str, src: Path) -> str:
    """An ext4 Volume with a file in it, under its old digest names."""
    hexname = hashlib.sha256(volume_id.encode()).hexdigest()
    root = pool / VOLUMES
    src.mkdir()
    (src / "kept.txt").write_bytes(b"written by v0.0.9\n")
    data = root / "data" / f"{hexname}.ext4"
    with open(data, "wb") as f:
        f.truncate(64 * MIB)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(src), str(data)], check=True)
    (root / "locks" / f"{hexname}.lock").write_bytes(b"")
    for sub in ("holders", "releases"):
        atomicfile.write_json(root / sub / f"{hexname}.json", {"node_id": "node-a",
                                                               "epoch": 1})
    atomicfile.write_json(root / "metadata" / f"{hexname}.json", {
        "version": 1, "kind": VOLUMES, "id": volume_id, "pool_id": "pool-a",
        "capacity_bytes": 64 * MIB, "state": "released", "holder": "node-a", "epoch": 1,
        "released_cleanly": True})
    return hexname


def storage(paths: dict[str, Path]) -> NodeStorage:
    pools = {(pid, VOLUMES): ln.NamedPoolObjects(pid, path, VOLUMES, "node-a",
                                                 receipt_wait=0.2)
             for pid, path in paths.items()}
    return NodeStorage(node_id="node-a", pool=lambda pid, kind: pools[(pid, kind)],
                       instances=list, shared_pools=dict.fromkeys(paths, False),
                       retained=set(), changed=lambda: None)


def read_back(image: Path, name: str) -> bytes:
    return subprocess.run(["debugfs", "-R", f"cat /{name}", str(image)], check=True,
                          capture_output=True).stdout


def make_pool(path: Path, pool_id: str) -> Path:
    init_pool(pool_id, path, adopt=True)
    prepare_pool_dirs(pool_id, path)
    return path


async def test_expand_renames_an_old_named_volume_then_grows_it(tmp_path: Path) -> None:
    pool = make_pool(tmp_path / "pool-a", "pool-a")
    hexname = old_ext4_volume(pool, "vol-legacy", tmp_path / "src")
    st = storage({"pool-a": pool})
    done = await st.object_expand("volume", "pool-a", "vol-legacy", 2, 128 * MIB)
    assert done == {"capacity_bytes": 128 * MIB}
    data = pool / VOLUMES / "data" / "vol-legacy.ext4"
    assert data.stat().st_size == 128 * MIB
    assert read_back(data, "kept.txt") == b"written by v0.0.9\n"
    leftover = [p for p in (pool / VOLUMES).rglob("*") if hexname in p.name]
    assert leftover == []


async def test_copy_renames_an_old_named_volume_before_copying(tmp_path: Path) -> None:
    a = make_pool(tmp_path / "pool-a", "pool-a")
    b = make_pool(tmp_path / "pool-b", "pool-b")
    old_ext4_volume(a, "vol-legacy", tmp_path / "src")
    st = storage({"pool-a": a, "pool-b": b})
    assert await st.object_copy("volume", "vol-legacy", "pool-a", "pool-b", 2) == {
        "copied": True}
    assert read_back(b / VOLUMES / "data" / "vol-legacy.ext4", "kept.txt") == \
        b"written by v0.0.9\n"
    assert (a / VOLUMES / "data" / "vol-legacy.ext4").is_file()
