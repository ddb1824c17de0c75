"""The ``local`` driver: is a pool directory on a local file system usable right now?

A node must not write Workspace data into a pool it cannot keep: a path that is missing
(usually: not mounted yet, so writing would fill the root disk), is not a directory, or
sits on a read-only mount (a file system remounted read-only after an I/O error is the
classic case).  The mount is found the way the kernel resolves it: the longest mount
point that is a prefix of the pool's real path, the last such entry winning when mounts
are stacked (`kibotos.sdk.procfs.find_mount`).  Mounts are read from
``<proc_root>/self/mounts`` so tests can point the driver at a prepared tree.  Every
check is a few system calls: cheap enough for the node's once-a-minute refresh, and it
never touches the network.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

from kibotos.sdk import Availability, HostPaths, PoolSpec, StorageDriver, backend_options, procfs


class LocalDriver(StorageDriver):
    """`kibotos.sdk.StorageDriver` for a directory on a local file system."""

    name: ClassVar[str] = "local"

    def __init__(self, options: Mapping[str, Any]) -> None:
        backend_options("storage_driver", self.name, options)

    def check(self, pool: PoolSpec, host: HostPaths) -> Availability:
        path = pool.path
        where = f"pool {pool.id}: {path}"
        try:
            st_is_dir = path.is_dir()
            exists = st_is_dir or path.exists()
        except OSError as exc:
            return Availability(False, f"{where} cannot be examined: {exc.strerror or exc}")
        if not exists:
            return Availability(False, f"{where} does not exist (is the pool mounted?)")
        if not st_is_dir:
            return Availability(False, f"{where} is not a directory")
        real = os.path.realpath(path)
        table = procfs.mounts_file(host.proc_root)
        try:
            mounts = procfs.read_mounts(host.proc_root)
        except OSError as exc:
            return Availability(False, f"{where}: cannot read {table}: {exc.strerror or exc}")
        mount = procfs.find_mount(mounts, real)
        if mount is None:
            return Availability(False, f"{where}: no mount in {table} holds {real}")
        if mount.read_only:
            return Availability(
                False,
                f"{where} is on a read-only mount ({mount.mount_point}, "
                f"{mount.fstype} from {mount.device})",
            )
        if not os.access(real, os.W_OK | os.X_OK):
            return Availability(False, f"{where} is not writable by this process")
        return Availability(True)
