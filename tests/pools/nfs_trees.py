"""Prepared /proc and /sys trees for the NFS drivers: there is no kernel NFS here."""

from __future__ import annotations

import os
from pathlib import Path

from kibotos.backends import HostPaths, PoolSpec

DEVICE = "0:53"


def make_host(tmp_path: Path, options: str, *, fstype: str = "nfs4",
              max_bytes: int | None = 4 * 2**30, strict: str = "0",
              device: str = DEVICE) -> tuple[HostPaths, Path]:
    """A pool directory mounted (in the prepared tables) as NFS with `options`; the
    writeback device directory holds `max_bytes` and `strict_limit` unless None."""
    pool = tmp_path / "pool"
    pool.mkdir(exist_ok=True)
    real = os.path.realpath(pool)
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "self" / "mounts").write_text(
        "/dev/sda1 / ext4 rw,relatime 0 0\n"
        f"nfs.example.com:/srv/pool {real} {fstype} {options} 0 0\n")
    (proc / "self" / "mountinfo").write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        f"36 22 {device} / {real} rw,relatime shared:9 - {fstype} "
        f"nfs.example.com:/srv/pool {options}\n")
    sys_root = tmp_path / "sys"
    bdi = sys_root / "class" / "bdi" / device
    bdi.mkdir(parents=True, exist_ok=True)
    if max_bytes is not None:
        (bdi / "max_bytes").write_text(f"{max_bytes}\n")
        (bdi / "strict_limit").write_text(f"{strict}\n")
    return HostPaths(proc_root=proc, sys_root=sys_root), pool


def spec(pool: Path, *, shared: bool = False, driver: str = "nfs") -> PoolSpec:
    return PoolSpec(id="pool-a", path=pool, shared=shared, driver=driver)
