"""Pool directories (owners, modes), leftovers per the spec's table, and availability:
marker reasons and recovery after a later `storage-pool init` without a restart."""

from __future__ import annotations

import grp
import os
import stat
import subprocess
from pathlib import Path

import pytest
import trio

from kibotos.config import NodeConfig
from kibotos.core.errors import FailedPrecondition
from kibotos.node.storage.pools import dirs, startup
from kibotos.node.storage.pools.marker import MISSING_REASON, init_pool
from kibotos.node.storage.pools.tempfiles import is_temp_name
from kibotos.plugins import load_plugins


def config(tmp_path: Path, pools: list[dict], node_id: str = "node-a") -> NodeConfig:
    return NodeConfig.model_validate({
        "node": {"id": node_id, "ctrl_url": "http://127.0.0.1:1"},
        "storage": {"root": str(tmp_path / "root"), "pool": pools},
        "resources": {"cpu": 1, "memory": "1G"},
        "host": {"proc_root": "/proc", "sys_root": "/sys"},
    })


def test_missing_pool_directory_fails_with_the_spec_message(tmp_path: Path):
    cfg = config(tmp_path, [{"id": "pool-a", "path": str(tmp_path / "absent")}])
    with pytest.raises(FailedPrecondition, match=r"prepare host layout: create .*/volumes"):
        startup.prepare(cfg)
    assert not (tmp_path / "absent").exists()


@pytest.mark.root
def test_layout_owners_and_modes(tmp_path: Path):
    pool = tmp_path / "pool"
    pool.mkdir(mode=0o755)
    before = os.stat(pool)
    startup.prepare(config(tmp_path, [{"id": "pool-a", "path": str(pool)}]))
    gid = grp.getgrnam("kibotos-vmm").gr_gid
    for kind, subs in (("volumes", ("data", "metadata", "holders", "releases", "locks",
                                    "transfer-staging")),
                       ("retained-layers", ("data", "metadata", "holders", "releases",
                                            "locks"))):
        st = os.stat(pool / kind)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, gid, 0o710)
        assert sorted(os.listdir(pool / kind)) == sorted(subs)
        data = os.stat(pool / kind / "data")
        assert (data.st_gid, stat.S_IMODE(data.st_mode)) == (gid, 0o710)
    after = os.stat(pool)  # the pool directory itself is the operator's
    assert (after.st_uid, after.st_gid, after.st_mode) == \
        (before.st_uid, before.st_gid, before.st_mode)
    block = pool / "volumes" / "data" / "vol-1.ext4"
    block.write_bytes(b"")
    dirs.hand_block_file(block, "volumes")
    st = os.stat(block)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, gid, 0o660)


@pytest.mark.root
def test_missing_vmm_group_is_created(tmp_path: Path):
    name = f"kbt-test-{os.getpid()}"
    try:
        gid = dirs.vmm_gid(name)
        assert grp.getgrnam(name).gr_gid == gid
        assert dirs.vmm_gid(name) == gid
    finally:
        subprocess.run(["groupdel", name], check=False)


def test_temp_name_shapes():
    for name in (".record-2826134621.tmp", ".node-a.import-1438876543.tmp",
                 ".node-a.download-import-3170412187.tar",
                 ".node-a.move-vol-06gdxke0wxw4xezwfa185wp24w-2004318071.tmp",
                 ".import-1438876543.tmp"):
        assert is_temp_name(name), name
    for name in ("vol-1.ext4", "vol-1.json", ".kibotos-storage-pool", "x-1.tmp",
                 ".notes.txt"):
        assert not is_temp_name(name), name


def _leftovers(pool: Path) -> dict[str, Path]:
    data = pool / "volumes" / "data"
    files = {
        "mine": data / ".node-a.import-1438876543.tmp",
        "mine-staging": pool / "volumes" / "transfer-staging" /
        ".node-a.download-import-3170412187.tar",
        "other": data / ".node-b.import-11.tmp",
        "legacy": data / ".import-1438876543.tmp",
        "object": data / "vol-1.ext4",
        "layer-meta": pool / "retained-layers" / "metadata" / ".node-b.ref-1-22.tmp",
    }
    for path in files.values():
        path.write_bytes(b"x")
    return files


def test_temp_files_deleted_per_table(tmp_path: Path):
    dedicated, shared = tmp_path / "dedicated", tmp_path / "shared"
    for p in (dedicated, shared):
        init_pool(p.name, p)
    cfg = config(tmp_path, [
        {"id": "dedicated", "path": str(dedicated), "default": True},
        {"id": "shared", "path": str(shared), "shared": True}])
    startup.prepare(cfg)
    local = cfg.storage.root / "runtime" / "registry"
    local.mkdir(parents=True)
    (local / ".record-2826134621.tmp").write_bytes(b"x")
    (local / "inst-1.json").write_bytes(b"{}")
    in_dedicated, in_shared = _leftovers(dedicated), _leftovers(shared)
    startup.prepare(cfg)  # local directories: all
    assert not (local / ".record-2826134621.tmp").exists()
    assert (local / "inst-1.json").exists()
    assert all(p.exists() for p in in_dedicated.values())  # pools wait for availability
    mon = startup.monitor(cfg, load_plugins().storage_driver)
    mon.refresh()
    assert mon.available("dedicated"), mon.states
    # dedicated: all temporary files, objects kept
    assert [k for k, p in in_dedicated.items() if p.exists()] == ["object"]
    # shared: only this node's
    assert sorted(k for k, p in in_shared.items() if p.exists()) == \
        ["layer-meta", "legacy", "object", "other"]


async def test_marker_reasons_and_recovery_without_restart(tmp_path: Path):
    missing, other = tmp_path / "missing", tmp_path / "other"
    missing.mkdir()
    init_pool("elsewhere", other)
    cfg = config(tmp_path, [{"id": "missing", "path": str(missing), "default": True},
                            {"id": "other", "path": str(other)}])
    startup.prepare(cfg)
    (missing / "volumes" / "data" / ".node-a.x-1.tmp").write_bytes(b"x")
    changes: list[int] = []
    mon = startup.monitor(cfg, load_plugins().storage_driver,
                          on_change=lambda: changes.append(1))
    mon.refresh()
    facts = {f["id"]: f for f in mon.facts()}
    assert facts["missing"]["available"] is False
    assert facts["missing"]["reason"] == MISSING_REASON
    assert facts["missing"]["instance"] is None
    assert facts["other"]["reason"].startswith("storage pool marker is invalid")
    assert "'elsewhere'" in facts["other"]["reason"]
    assert (missing / "volumes" / "data" / ".node-a.x-1.tmp").exists()
    assert not (missing / ".kibotos-storage-pool").exists()  # never created by the node

    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: mon.run(interval=0.05,
                                                        task_status=task_status))
        res = await trio.to_thread.run_sync(
            lambda: init_pool("missing", missing, adopt=True))
        with trio.fail_after(60):
            while not (mon.available("missing") and changes):
                await trio.sleep(0.05)
        state = {f["id"]: f for f in mon.facts()}["missing"]
        assert state["instance"] == res.marker.instance
        assert state["reason"] is None
        nursery.cancel_scope.cancel()
    assert changes
    # cleaned when it became available
    assert not (missing / "volumes" / "data" / ".node-a.x-1.tmp").exists()


def test_unknown_driver_makes_only_that_pool_unavailable(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    init_pool("a", a)
    init_pool("b", b)
    cfg = config(tmp_path, [{"id": "a", "path": str(a), "default": True},
                            {"id": "b", "path": str(b), "driver": "no-such"}])
    mon = startup.monitor(cfg, load_plugins().storage_driver)
    mon.refresh()
    assert mon.available("a")
    assert not mon.available("b")
    assert "no-such" in mon.states["b"].reason
