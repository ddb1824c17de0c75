"""Rows of spec/storage-pools-on-nfs.txt that had no test (docs/storage-spec-coverage.md):
a pool directory the VMM identity cannot traverse, an object lock that stays held, a
block file that cannot be handed to the VMM identity (root_squash), the shape of the IDs
ctrl makes, and the ``[[storage.pool]]`` configuration rules."""

from __future__ import annotations

import errno
import fcntl
import grp
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from kibotos.config import NodeConfig
from kibotos.core import ids
from kibotos.core.errors import Aborted, FailedPrecondition, InvalidArgument
from kibotos.node.storage.objects import RETAINED_LAYERS, VOLUMES, PoolObjects
from kibotos.node.storage.pools import dirs, startup
from kibotos.node.storage.pools.marker import init_pool

MIB = 1 << 20


def config(tmp_path: Path, pools: list[dict], **storage: object) -> NodeConfig:
    return NodeConfig.model_validate({
        "node": {"id": "node-a", "ctrl_url": "http://127.0.0.1:1"},
        "storage": {"root": str(tmp_path / "root"), "pool": pools, **storage},
        "resources": {"cpu": 1, "memory": "1G"},
        "host": {"proc_root": "/proc", "sys_root": "/sys"},
    })


def vmm_gid() -> int:
    return grp.getgrnam(dirs.VMM_GROUP).gr_gid


# ---------------------------------------------------------------- traversal (troubleshooting)

@pytest.mark.root
def test_a_pool_directory_the_vmm_cannot_traverse_stops_the_start(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    pool.mkdir()
    os.chmod(pool, 0o700)  # root:root 0700, as `install -d -m 0700` or a fresh mount
    cfg = config(tmp_path, [{"id": "pool-a", "path": str(pool)}])
    with pytest.raises(FailedPrecondition) as err:
        startup.prepare(cfg)
    msg = err.value.message
    assert f"pool directory {pool} of pool 'pool-a' is not traversable by VMM identity" in msg
    assert f"chown root:kibotos-vmm {pool}" in msg
    assert f"chmod 0710 {pool}" in msg
    assert os.listdir(pool) == []  # nothing created, the directory itself unchanged
    assert stat.S_IMODE(os.stat(pool).st_mode) == 0o700

    os.chmod(pool, 0o750)  # the group may traverse, but the group is root's
    with pytest.raises(FailedPrecondition, match="not traversable by VMM identity"):
        startup.prepare(cfg)

    os.chown(pool, 0, vmm_gid())  # what Prerequisites tell the operator to run
    os.chmod(pool, 0o710)
    startup.prepare(cfg)
    assert (pool / "volumes" / "data").is_dir()
    assert stat.S_IMODE(os.stat(pool).st_mode) == 0o710  # still the operator's


@pytest.mark.root
def test_others_may_traverse_too_and_the_storage_root_is_not_checked(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    pool.mkdir()
    os.chmod(pool, 0o701)
    startup.prepare(config(tmp_path, [{"id": "pool-a", "path": str(pool)}]))
    root = tmp_path / "root"
    root.mkdir(mode=0o700, exist_ok=True)  # the node's own storage root (its layout)
    startup.prepare(config(tmp_path, [{"id": "pool-r", "path": str(root)}]))
    assert (root / "retained-layers" / "data").is_dir()


@pytest.mark.root
def test_init_makes_a_missing_pool_directory_the_vmm_can_traverse(tmp_path: Path) -> None:
    pool = tmp_path / "deep" / "pool"
    init_pool("pool-a", pool)
    st = os.stat(pool)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, vmm_gid(), 0o710)
    startup.prepare(config(tmp_path, [{"id": "pool-a", "path": str(pool)}]))


@pytest.mark.root
def test_the_node_process_exits_with_the_traversal_message(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    pool.mkdir()
    os.chmod(pool, 0o700)
    init_pool("pool-a", pool, adopt=True)
    conf = tmp_path / "node.toml"
    conf.write_text(f"""
[node]
id = "node-a"
ctrl_url = "http://127.0.0.1:9"
socket_dir = "{tmp_path / 'run'}"
[storage]
root = "{tmp_path / 'root'}"
[[storage.pool]]
id = "pool-a"
path = "{pool}"
[resources]
cpu = 1
memory = "1G"
""")
    proc = subprocess.run([sys.executable, "-m", "kibotos.cli.main", "node", "serve",
                           "--config", str(conf)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 13, proc.stderr
    assert "is not traversable by VMM identity" in proc.stderr
    assert str(pool) in proc.stderr
    assert sorted(os.listdir(pool)) == [".kibotos-storage-pool"]


# ---------------------------------------------------------------- the object lock

def _objects(pool: Path, kind: str) -> PoolObjects:
    dirs.prepare_pool_dirs("pool-a", pool)
    objs = PoolObjects("pool-a", pool, kind, "node-a", receipt_wait=0.3)
    objs.lock_wait = 0.3
    return objs


def _hold(path: Path) -> int:
    """Another holder of the flock (its own open file description)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


@pytest.mark.parametrize(("kind", "oid", "words"), [
    (VOLUMES, "vol-1", "Volume operation lock is held"),
    (RETAINED_LAYERS, "lay-1", "retained layer lock is held"),
])
async def test_a_held_object_lock_is_a_retryable_conflict(tmp_path: Path, kind: str, oid: str,
                                                          words: str) -> None:
    objs = _objects(tmp_path, kind)
    fd = _hold(tmp_path / kind / "locks" / f"{oid}.lock")
    try:
        with pytest.raises(Aborted) as err:
            await objs.open(oid, 1, create_capacity=16 * MIB)
        assert err.value.message.startswith(words)
        assert err.value.retryable
        assert err.value.details["reason"] == "object_lock_held"
        with pytest.raises(Aborted, match=words):
            objs.delete(oid, 1)
        assert not (tmp_path / kind / "holders" / f"{oid}.json").exists()
        assert os.listdir(tmp_path / kind / "data") == []
    finally:
        os.close(fd)
    opened = await objs.open(oid, 1, create_capacity=16 * MIB)  # the retry succeeds
    assert opened.created


def test_a_lock_released_within_the_wait_is_taken(tmp_path: Path) -> None:
    objs = _objects(tmp_path, VOLUMES)
    objs.lock_wait = 60.0
    fd = _hold(tmp_path / VOLUMES / "locks" / "vol-1.lock")
    timer = threading.Timer(0.3, os.close, (fd,))
    timer.start()
    try:
        assert objs.delete("vol-1", 1) is False  # waited for the lock, then nothing there
    finally:
        timer.join()


# ---------------------------------------------------------------- root_squash (troubleshooting)

@pytest.mark.root
@pytest.mark.parametrize(("kind", "label"), [(VOLUMES, "raw Volume"),
                                             (RETAINED_LAYERS, "retained layer")])
def test_a_block_file_that_cannot_be_handed_over_names_the_step(tmp_path: Path, kind: str,
                                                                label: str) -> None:
    block = tmp_path / "x.ext4"
    block.write_bytes(b"")
    subprocess.run(["chattr", "+i", str(block)], check=True)  # chown/chmod now EPERM
    try:
        with pytest.raises(FailedPrecondition) as err:
            dirs.hand_block_file(block, kind)
    finally:
        subprocess.run(["chattr", "-i", str(block)], check=True)
    assert err.value.message.startswith(f"hand {label} to the VMM identity: ")
    assert "no_root_squash" in err.value.message


@pytest.mark.root
async def test_a_squashed_chown_fails_the_create_and_leaves_no_block_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    objs = _objects(tmp_path, VOLUMES)

    def squashed(*args: object, **kwargs: object) -> None:
        # what an NFS export with root_squash answers root's chown
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(dirs.os, "chown", squashed)
    with pytest.raises(FailedPrecondition, match="hand raw Volume to the VMM identity"):
        await objs.open("vol-1", 1, create_capacity=16 * MIB)
    assert os.listdir(tmp_path / VOLUMES / "data") == []


# ---------------------------------------------------------------- IDs ctrl makes

@pytest.mark.parametrize("prefix", ["vol", "lay", "ws"])
def test_the_ids_ctrl_makes_fit_the_object_id_shape(prefix: str) -> None:
    for _ in range(50):
        value = ids.new_id(prefix)
        assert ids.check_object_id(value) == value
        assert len(value.encode()) <= 32
        assert value == value.lower()


@pytest.mark.parametrize("bad", ["..", ".", "a/b", "/x", "Vol-1", "v" * 33, "-v", "", "a b",
                                 "a.b", "vol-é", "a\x00"])
def test_the_object_id_shape_refuses(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="1-32 bytes of lowercase letters"):
        ids.check_object_id(bad)


# ---------------------------------------------------------------- [[storage.pool]]

@pytest.mark.parametrize(("pools", "words"), [
    ([{"id": "Pool-A", "path": "/p"}], "pool ID"),
    ([{"id": "-a", "path": "/p"}], "pool ID"),
    ([{"id": "a.", "path": "/p"}], "pool ID"),
    ([{"id": "a/b", "path": "/p"}], "pool ID"),
    ([{"id": "p" * 64, "path": "/p"}], "pool ID"),
    ([{"id": "a", "path": "rel/p"}], "must be absolute"),
    ([{"id": "a", "path": "/p"}, {"id": "b", "path": "/q"}], "exactly one must have default"),
    ([{"id": "a", "path": "/p", "default": True}, {"id": "b", "path": "/q", "default": True}],
     "exactly one must have default"),
    ([{"id": "a", "path": "/p", "default": True}, {"id": "a", "path": "/q"}],
     "declared twice"),
    ([{"id": "a", "path": "/p", "capacity": "1T"}], "storage.pool.capacity was removed"),
])
def test_pool_configuration_rules_refuse(tmp_path: Path, pools: list[dict], words: str
                                         ) -> None:
    with pytest.raises(ValidationError, match=words):
        config(tmp_path, pools)


def test_pool_configuration_rules_accept(tmp_path: Path) -> None:
    one = config(tmp_path, [{"id": "p" * 63, "path": "/p"}])
    assert one.storage.default_pool() is not None  # one pool: implicitly the default
    two = config(tmp_path, [{"id": "a.b-1", "path": "/p"},
                            {"id": "shared-a", "path": "/q", "default": True, "shared": True}])
    default = two.storage.default_pool()
    assert default is not None
    assert default.id == "shared-a"
    assert default.shared
    at_root = config(tmp_path, [{"id": "a", "path": str(tmp_path / "root")}])
    assert at_root.storage.pool[0].path == at_root.storage.root
