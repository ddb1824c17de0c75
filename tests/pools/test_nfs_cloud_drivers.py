"""The ``nfs`` and ``cloud-nas`` drivers against prepared /proc and /sys trees: the shared
conformance suite of the pool driver seam (`kibotos.testing.pool_driver_suite`), then
the mount option rules of "Prerequisites", "NFS versions" and "Cloud provider NAS", and
the writeback limit of "Notes" (spec: storage-pools-on-nfs)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from kibotos_cloud_nas import CloudNasDriver
from kibotos_nfs import MAX_BYTES, NfsDriver
from nfs_trees import DEVICE, make_host, spec

from kibotos.backends import HostPaths, PoolSpec
from kibotos.plugins import load_plugins
from kibotos.testing.conformance import BackendFactory, check_id
from kibotos.testing.pool_driver_suite import POOL_DRIVER_CHECKS, PoolDriverCheck

GOOD = "rw,relatime,vers=4.2,rsize=1048576,wsize=1048576,hard,proto=tcp,local_lock=none"


def driver(name: str = "nfs"):
    return load_plugins().storage_driver.get(name)({})


def usable_nfs_pool(directory: Path) -> tuple[PoolSpec, HostPaths]:
    host, pool = make_host(directory, GOOD + ",noresvport")
    return spec(pool), host


@pytest.mark.parametrize("check", POOL_DRIVER_CHECKS, ids=check_id)
@pytest.mark.parametrize("cls", [NfsDriver, CloudNasDriver], ids=["nfs", "cloud-nas"])
def test_conformance(cls: type, check: PoolDriverCheck, tmp_path: Path) -> None:
    check(BackendFactory(cls, {}), usable_nfs_pool, tmp_path)


def test_both_drivers_are_registered_builtins():
    regs = load_plugins()
    infos = {(i.kind, i.name): i for i in regs.infos}
    assert infos[("storage_driver", "nfs")].source == "builtin"
    assert infos[("storage_driver", "nfs")].module == "kibotos_nfs.driver"
    assert infos[("storage_driver", "cloud-nas")].source == "builtin"
    assert infos[("storage_driver", "cloud-nas")].plugin == "cloud-nas"


def test_good_mount_is_available_and_limit_set(tmp_path: Path):
    host, pool = make_host(tmp_path, GOOD)
    result = driver().check(spec(pool), host)
    assert result.available, result.reason
    bdi = host.sys_root / "class" / "bdi" / DEVICE
    assert int((bdi / "max_bytes").read_text()) == MAX_BYTES == 256 * 2**20
    assert (bdi / "strict_limit").read_text().strip() == "1"


def test_smaller_max_bytes_is_kept(tmp_path: Path):
    host, pool = make_host(tmp_path, GOOD, max_bytes=64 * 2**20)
    assert driver().check(spec(pool), host).available
    bdi = host.sys_root / "class" / "bdi" / DEVICE
    assert int((bdi / "max_bytes").read_text()) == 64 * 2**20
    assert (bdi / "strict_limit").read_text().strip() == "1"


def test_device_from_stat_when_mountinfo_lacks_the_mount(tmp_path: Path):
    host, pool = make_host(tmp_path, GOOD)
    (host.proc_root / "self" / "mountinfo").write_text("")
    import os
    st = os.stat(pool).st_dev
    dev = f"{os.major(st)}:{os.minor(st)}"
    result = driver().check(spec(pool), host)
    assert not result.available
    assert dev in result.reason
    assert "limit the dirty page cache" in result.reason
    bdi = host.sys_root / "class" / "bdi" / dev
    bdi.mkdir(parents=True)
    (bdi / "max_bytes").write_text("999999999999\n")
    (bdi / "strict_limit").write_text("0\n")
    assert driver().check(spec(pool), host).available
    assert int((bdi / "max_bytes").read_text()) == MAX_BYTES


def test_old_kernel_without_max_bytes_is_unavailable(tmp_path: Path):
    host, pool = make_host(tmp_path, GOOD, max_bytes=None)
    result = driver().check(spec(pool), host)
    assert not result.available
    assert "limit the dirty page cache" in result.reason
    assert DEVICE in result.reason


@pytest.mark.root
def test_read_only_sysfs_is_unavailable_with_the_device(tmp_path: Path):
    host, pool = make_host(tmp_path, GOOD)
    bdi = host.sys_root / "class" / "bdi" / DEVICE
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(bdi)], check=True)
    try:
        (bdi / "max_bytes").write_text(f"{4 * 2**30}\n")
        (bdi / "strict_limit").write_text("0\n")
        subprocess.run(["mount", "-o", "remount,ro", str(bdi)], check=True)
        result = driver().check(spec(pool), host)
        assert not result.available
        assert "limit the dirty page cache" in result.reason
        assert DEVICE in result.reason
        assert "Read-only file system" in result.reason
    finally:
        subprocess.run(["umount", str(bdi)], check=True)


@pytest.mark.parametrize(("options", "needle"), [
    ("rw,hard,proto=tcp", "not stated"),
    ("rw,vers=4,hard", "not stated"),              # minor version negotiated
    ("rw,vers=4.3,hard", "not supported"),
    ("rw,vers=4.2,soft", "not hard"),
    ("rw,vers=4.2,softerr", "not hard"),
    ("rw,vers=4.2", "not hard"),
    ("rw,vers=3,hard,nolock", "nolock"),
    ("rw,vers=3,hard,local_lock=all", "local_lock=all"),
    ("ro,vers=4.1,hard", "read-only"),
])
def test_nfs_option_rules_refuse(tmp_path: Path, options: str, needle: str):
    host, pool = make_host(tmp_path, options)
    result = driver().check(spec(pool), host)
    assert not result.available
    assert needle in result.reason
    # refused before the writeback device is touched
    bdi = host.sys_root / "class" / "bdi" / DEVICE
    assert (bdi / "strict_limit").read_text().strip() == "0"


@pytest.mark.parametrize("options", [
    "rw,vers=3,hard,local_lock=none", "rw,vers=4.0,hard", "rw,vers=4.1,hard",
    "rw,vers=4,minorversion=1,hard", "rw,nfsvers=4.2,hard"])
def test_nfs_accepts_each_stated_version(tmp_path: Path, options: str):
    host, pool = make_host(tmp_path, options, fstype="nfs" if "vers=3" in options else "nfs4")
    result = driver().check(spec(pool), host)
    assert result.available, result.reason


def test_nocto_refused_only_on_a_shared_pool(tmp_path: Path):
    host, pool = make_host(tmp_path, GOOD + ",nocto")
    assert driver().check(spec(pool), host).available
    result = driver().check(spec(pool, shared=True), host)
    assert not result.available
    assert "nocto" in result.reason


def test_not_on_nfs_is_unavailable(tmp_path: Path):
    host, pool = make_host(tmp_path, "rw,relatime", fstype="ext4")
    result = driver().check(spec(pool), host)
    assert not result.available
    assert "not on an NFS mount" in result.reason


def test_cloud_nas_v3_needs_nolock(tmp_path: Path):
    host, pool = make_host(tmp_path, "rw,vers=3,hard,noacl,noresvport", fstype="nfs")
    result = driver("cloud-nas").check(spec(pool, driver="cloud-nas"), host)
    assert not result.available
    assert "needs nolock" in result.reason
    host, pool = make_host(tmp_path, "rw,vers=3,nolock,noacl,noresvport,hard,"
                           "local_lock=all", fstype="nfs")
    result = driver("cloud-nas").check(spec(pool, driver="cloud-nas"), host)
    assert result.available, result.reason
    assert result.warnings == ()


def test_cloud_nas_v4_refuses_nolock(tmp_path: Path):
    host, pool = make_host(tmp_path, "rw,vers=4,minorversion=0,hard,nolock,noresvport")
    result = driver("cloud-nas").check(spec(pool, driver="cloud-nas"), host)
    assert not result.available
    assert "nolock" in result.reason


def test_cloud_nas_without_noresvport_is_a_warning_only(tmp_path: Path):
    host, pool = make_host(tmp_path, "rw,vers=4.0,hard")
    result = driver("cloud-nas").check(spec(pool, driver="cloud-nas"), host)
    assert result.available
    assert result.reason is None
    assert len(result.warnings) == 1
    assert "noresvport" in result.warnings[0]


def test_cloud_nas_keeps_the_common_rules(tmp_path: Path):
    host, pool = make_host(tmp_path, "rw,vers=3,nolock,soft,noresvport", fstype="nfs")
    result = driver("cloud-nas").check(spec(pool, driver="cloud-nas"), host)
    assert not result.available
    assert "not hard" in result.reason
