"""The ``local`` storage driver against prepared /proc trees (and once against the real
one): the shared conformance suite of the pool driver seam
(`kibotos.testing.pool_driver_suite`), then the local driver's own rules: read-only
mounts, which mount holds the pool, and reasons that name the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
from kibotos_local.driver import LocalDriver

from kibotos.backends import HostPaths, PoolSpec, StorageDriver
from kibotos.core.errors import InvalidArgument
from kibotos.plugins import load_plugins
from kibotos.testing.conformance import BackendFactory, check_id
from kibotos.testing.pool_driver_suite import POOL_DRIVER_CHECKS, PoolDriverCheck


@pytest.fixture(scope="module")
def driver() -> StorageDriver:
    return load_plugins().storage_driver.get("local")({})


def prepared_proc(tmp_path: Path, lines: list[str]) -> HostPaths:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mounts").write_text("".join(line + "\n" for line in lines))
    return HostPaths(proc_root=proc)


def escaped(path: Path) -> str:
    """A path the way the kernel writes it in /proc/self/mounts."""
    return str(path).replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")


@pytest.fixture
def pool_dir(tmp_path: Path) -> Path:
    path = tmp_path / "mnt" / "pool-a"
    path.mkdir(parents=True)
    return path


def pool(path: Path) -> PoolSpec:
    return PoolSpec(id="pool-a", path=path)


def usable_pool(directory: Path) -> tuple[PoolSpec, HostPaths]:
    """A pool directory on a writable xfs mount, for the conformance suite."""
    path = directory / "mnt" / "pool-a"
    path.mkdir(parents=True)
    return pool(path), prepared_proc(directory, [
        "/dev/vda1 / ext4 rw,relatime 0 0",
        f"/dev/vdb1 {escaped(directory / 'mnt')} xfs rw,noatime 0 0",
    ])


@pytest.mark.parametrize("check", POOL_DRIVER_CHECKS, ids=check_id)
def test_conformance(check: PoolDriverCheck, tmp_path: Path) -> None:
    check(BackendFactory(LocalDriver, {}), usable_pool, tmp_path)


def test_the_plugin_registers_the_local_driver(driver):
    assert load_plugins().storage_driver.get("local") is LocalDriver
    assert isinstance(driver, StorageDriver)


def test_read_only_mount_is_unavailable_with_reason(driver, tmp_path, pool_dir):
    mnt = tmp_path / "mnt"
    host = prepared_proc(tmp_path, [
        "/dev/vda1 / ext4 rw,relatime 0 0",
        f"/dev/vdb1 {escaped(mnt)} xfs ro,noatime 0 0",
    ])
    result = driver.check(pool(pool_dir), host)
    assert not result.available
    assert result.reason == (
        f"pool pool-a: {pool_dir} is on a read-only mount ({mnt}, xfs from /dev/vdb1)"
    )


def test_longest_mount_point_prefix_decides(driver, tmp_path, pool_dir):
    # The root is read-only but the pool's own, deeper mount is writable, and a
    # read-only mount at a sibling whose name is a string prefix does not count.
    host = prepared_proc(tmp_path, [
        "/dev/vda1 / ext4 ro,relatime 0 0",
        f"/dev/vdb1 {escaped(pool_dir)} ext4 rw 0 0",
        f"/dev/vdc1 {escaped(pool_dir)}-old ext4 ro 0 0",
        f"/dev/vdd1 {escaped(pool_dir / 'volumes')} ext4 ro 0 0",
    ])
    assert driver.check(pool(pool_dir), host).available
    host = prepared_proc(tmp_path / "second", [
        f"/dev/vdb1 {escaped(pool_dir)} ext4 ro 0 0",
        "/dev/vda1 / ext4 rw,relatime 0 0",
    ])
    result = driver.check(pool(pool_dir), host)
    assert not result.available
    assert "read-only mount" in (result.reason or "")


def test_last_of_stacked_mounts_wins(driver, tmp_path, pool_dir):
    mnt = escaped(tmp_path / "mnt")
    ro_on_top = prepared_proc(tmp_path / "a", [
        "/dev/vda1 / ext4 rw 0 0", f"/dev/vdb1 {mnt} ext4 rw 0 0", f"/dev/vdb1 {mnt} ext4 ro 0 0",
    ])
    rw_on_top = prepared_proc(tmp_path / "b", [
        "/dev/vda1 / ext4 rw 0 0", f"/dev/vdb1 {mnt} ext4 ro 0 0", f"/dev/vdb1 {mnt} ext4 rw 0 0",
    ])
    assert not driver.check(pool(pool_dir), ro_on_top).available
    assert driver.check(pool(pool_dir), rw_on_top).available


def test_octal_escapes_in_mount_points(driver, tmp_path):
    path = tmp_path / "with space" / "pool"
    path.mkdir(parents=True)
    host = prepared_proc(tmp_path, [
        "/dev/vda1 / ext4 rw 0 0",
        f"/dev/vdb1 {escaped(tmp_path / 'with space')} ext4 ro 0 0",
    ])
    result = driver.check(pool(path), host)
    assert not result.available
    assert f"({tmp_path / 'with space'}, ext4 from /dev/vdb1)" in (result.reason or "")


def test_symlinked_pool_path_is_judged_by_its_target(driver, tmp_path, pool_dir):
    link = tmp_path / "pool-link"
    link.symlink_to(pool_dir)
    host = prepared_proc(tmp_path, [
        "/dev/vda1 / ext4 rw 0 0",
        f"/dev/vdb1 {escaped(tmp_path / 'mnt')} ext4 ro 0 0",
    ])
    result = driver.check(pool(link), host)
    assert not result.available
    assert f"pool pool-a: {link} is on a read-only mount" in (result.reason or "")


def test_no_covering_mount_is_unavailable(driver, tmp_path, pool_dir):
    host = prepared_proc(tmp_path, ["garbage", "/dev/vdb1 /elsewhere ext4 rw 0 0"])
    result = driver.check(pool(pool_dir), host)
    assert not result.available
    assert "no mount in" in (result.reason or "")


def test_real_proc_sees_a_writable_temporary_directory(driver, tmp_path, pool_dir):
    assert driver.check(pool(pool_dir), HostPaths()).available


def test_options_are_refused():
    cls = load_plugins().storage_driver.get("local")
    with pytest.raises(InvalidArgument,
                       match=r"^storage driver local: unknown option writeback \(it takes none\)$"):
        cls({"writeback": "1G"})
