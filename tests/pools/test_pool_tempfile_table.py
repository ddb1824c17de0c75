"""Every row of "Temporary files from interrupted writes" (spec: node-and-vmm-processes):
local directories all, a dedicated pool all (an unavailable one once it is available), a
shared pool only this node's; v0.1.x names without a node ID left and logged."""

from __future__ import annotations

import logging
from pathlib import Path

from kibotos.config import NodeConfig
from kibotos.node.storage.pools import startup
from kibotos.node.storage.pools.marker import init_pool
from kibotos.plugins import load_plugins

#: The spec's examples, by where they are written (relative to a pool).
POOL_TEMPS = {
    "import": "volumes/data/.node-a.import-1438876543.tmp",
    "staging": "volumes/transfer-staging/.node-a.download-import-3170412187.tar",
    "move": "volumes/data/.node-a.move-vol-06gdxke0wxw4xezwfa185wp24w-2004318071.tmp",
    "layer-record": "retained-layers/metadata/.node-a.ws-1-77.tmp",
    "marker": ".node-a.kibotos-storage-pool-5.tmp",
    "v01x": "volumes/data/.import-1438876543.tmp",
    "other-node": "volumes/holders/.node-b.vol-1-9.tmp",
    "removed-node": "retained-layers/data/.node-gone.import-12.tmp",
}
#: Files that are not temporary and must survive every sweep.
KEEP = ["volumes/data/vol-1.ext4", "volumes/metadata/vol-1.json", "volumes/locks/vol-1.lock",
        ".kibotos-storage-pool"]


def config(tmp_path: Path, pools: list[dict]) -> NodeConfig:
    return NodeConfig.model_validate({
        "node": {"id": "node-a", "ctrl_url": "http://127.0.0.1:1"},
        "storage": {"root": str(tmp_path / "root"), "pool": pools},
        "resources": {"cpu": 1, "memory": "1G"},
        "host": {"proc_root": "/proc", "sys_root": "/sys"},
    })


def plant(pool: Path) -> None:
    for rel in [*POOL_TEMPS.values(), *KEEP[:-1]]:
        (pool / rel).write_bytes(b"x")


def left(pool: Path) -> set[str]:
    return {k for k, rel in POOL_TEMPS.items() if (pool / rel).exists()}


def kept(pool: Path) -> bool:
    return all((pool / rel).exists() for rel in KEEP)


def test_local_directories_lose_every_temporary_file(tmp_path: Path):
    pool = tmp_path / "pool"
    init_pool("pool-a", pool)
    cfg = config(tmp_path, [{"id": "pool-a", "path": str(pool)}])
    root = cfg.storage.root
    temps = [root / "runtime" / "registry" / ".record-2826134621.tmp",
             root / "state" / ".incarnation-4.tmp",
             root / "template-cache" / "sha256" / ".node-a.download-77.tmp",
             root / "runtime" / "instances" / "inst-1" / ".instance-8.tmp"]
    for path in temps:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    (root / "state" / "incarnation").write_text("3")
    startup.prepare(cfg)
    assert not [p for p in temps if p.exists()]
    assert (root / "state" / "incarnation").exists()


def test_dedicated_pool_loses_all_of_them_once_available(tmp_path: Path):
    pool = tmp_path / "pool"
    init_pool("pool-a", pool)
    cfg = config(tmp_path, [{"id": "pool-a", "path": str(pool)}])
    startup.prepare(cfg)
    plant(pool)
    startup.prepare(cfg)  # the start's local sweep leaves pools to the pool rules
    assert left(pool) == set(POOL_TEMPS)
    startup.monitor(cfg, load_plugins().storage_driver).refresh()
    assert left(pool) == set()
    assert kept(pool)


def test_unavailable_dedicated_pool_is_swept_when_it_becomes_available(tmp_path: Path):
    pool = tmp_path / "pool"
    pool.mkdir()
    cfg = config(tmp_path, [{"id": "pool-a", "path": str(pool)}])
    startup.prepare(cfg)
    plant(pool)
    mon = startup.monitor(cfg, load_plugins().storage_driver)
    mon.refresh()
    assert not mon.available("pool-a")  # no marker yet
    assert left(pool) == set(POOL_TEMPS)
    init_pool("pool-a", pool, adopt=True)
    mon.refresh()
    assert mon.available("pool-a")
    assert left(pool) == set()
    assert kept(pool)


def test_shared_pool_loses_only_this_nodes_files(tmp_path: Path, caplog):
    pool = tmp_path / "pool"
    init_pool("shared", pool)
    cfg = config(tmp_path, [{"id": "shared", "path": str(pool), "shared": True}])
    startup.prepare(cfg)
    plant(pool)
    with caplog.at_level(logging.INFO, logger="kibotos.node"):
        startup.monitor(cfg, load_plugins().storage_driver).refresh()
    assert left(pool) == {"v01x", "other-node", "removed-node"}
    assert kept(pool)
    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("node temporary files left"))
    assert "where=\"pool shared\"" in line
    assert "count=3" in line
    assert "shared=true" in line
    assert "stopping every node" in line
    assert ".import-1438876543.tmp" in line  # the v0.1.x file is named


def test_shared_pool_at_the_storage_root_follows_the_pool_rule(tmp_path: Path):
    """``path`` may equal ``storage.root``: the local sweep must not take another node's
    files from the pool's subdirectories."""
    root = tmp_path / "root"
    init_pool("shared", root)
    cfg = config(tmp_path, [{"id": "shared", "path": str(root), "shared": True}])
    startup.prepare(cfg)
    plant(root)
    local = root / "runtime" / "registry" / ".record-1.tmp"
    local.parent.mkdir(parents=True)
    local.write_bytes(b"x")
    startup.prepare(cfg)
    assert not local.exists()
    # (this node's own temporary marker file, directly in storage.root, goes either way)
    assert left(root) | {"marker"} == set(POOL_TEMPS)
    startup.monitor(cfg, load_plugins().storage_driver).refresh()
    assert left(root) == {"v01x", "other-node", "removed-node"}
