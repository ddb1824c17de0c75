"""The NFS mount that holds a pool, read from the kernel's mount tables.

``<proc_root>/self/mounts`` gives the options in effect (the kernel writes every NFS
option it applied, including the version it actually uses); ``self/mountinfo`` gives
the mount's device number, which names its writeback device under
``/sys/class/bdi/<major>:<minor>``.  Both are read through `kibotos.sdk.procfs` from
`HostPaths.proc_root`, so tests drive the driver with prepared trees.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kibotos.sdk import procfs

NFS_TYPES = ("nfs", "nfs4")
#: One line of the ``mounts`` table: the NFS options the kernel applied.
NfsMount = procfs.Mount


def mountinfo_device(proc_root: Path, mount_point: str) -> str | None:
    """``major:minor`` of the last mount at `mount_point` in ``self/mountinfo``."""
    try:
        table = procfs.read_mountinfo(proc_root)
    except OSError:
        return None
    found = None
    for entry in table:
        if entry.mount_point == mount_point:
            found = entry.device
    return found


def device_number(proc_root: Path, mount: NfsMount, path: Path) -> str:
    """The mount's device as ``major:minor``: from mountinfo, else ``stat``."""
    dev = mountinfo_device(proc_root, mount.mount_point)
    if dev is not None and re.fullmatch(r"\d+:\d+", dev):
        return dev
    st_dev = os.stat(path).st_dev
    return f"{os.major(st_dev)}:{os.minor(st_dev)}"
