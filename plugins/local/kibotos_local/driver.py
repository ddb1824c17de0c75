"""The ``local`` driver: is a pool directory on a local file system usable right now?

A node must not write Workspace data into a pool it cannot keep: a path that is missing
(usually: not mounted yet, so writing would fill the root disk), is not a directory, or
sits on a read-only mount (a file system remounted read-only after an I/O error is the
classic case).  The mount is found the way the kernel resolves it: the longest mount
point that is a prefix of the pool's real path, the last such entry winning when mounts
are stacked.  Mounts are read from ``<proc_root>/self/mounts`` so tests can point the
driver at a prepared tree.  Every check is a few system calls: cheap enough for the
node's once-a-minute refresh, and it never touches the network.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

from kibotos.backends import Availability, HostPaths, PoolSpec
from kibotos.errors import InvalidArgument

_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mounts, with the kernel's octal escapes decoded."""

    device: str
    mount_point: str
    fstype: str
    options: tuple[str, ...]

    @property
    def read_only(self) -> bool:
        return "ro" in self.options


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mounts(text: str) -> list[Mount]:
    """Parse the mounts table; malformed lines are skipped, not fatal (the kernel does
    not write them, and one odd line must not hide every pool)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        mounts.append(
            Mount(
                device=_unescape(fields[0]),
                mount_point=_unescape(fields[1]),
                fstype=fields[2],
                options=tuple(fields[3].split(",")),
            )
        )
    return mounts


def _covers(mount_point: str, path: PurePosixPath) -> bool:
    mp = PurePosixPath(mount_point)
    return mp.is_absolute() and (path == mp or mp in path.parents)


def find_mount(mounts: Sequence[Mount], path: Path | str) -> Mount | None:
    """The mount that holds `path`: longest covering mount point, last one if stacked."""
    target = PurePosixPath(path)
    best: Mount | None = None
    best_depth = -1
    for mount in mounts:
        if not _covers(mount.mount_point, target):
            continue
        depth = len(PurePosixPath(mount.mount_point).parts)
        if depth >= best_depth:
            best, best_depth = mount, depth
    return best


class LocalDriver:
    """`kibotos.backends.StorageDriver` for a directory on a local file system."""

    name: ClassVar[str] = "local"

    def __init__(self, options: Mapping[str, Any]) -> None:
        if options:
            raise InvalidArgument(
                f"storage driver local takes no options, got {', '.join(sorted(options))}"
            )

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
        mounts_file = host.proc_root / "self" / "mounts"
        try:
            mounts = parse_mounts(mounts_file.read_text(encoding="utf-8", errors="replace"))
        except OSError as exc:
            return Availability(
                False, f"{where}: cannot read {mounts_file}: {exc.strerror or exc}"
            )
        mount = find_mount(mounts, real)
        if mount is None:
            return Availability(False, f"{where}: no mount in {mounts_file} holds {real}")
        if mount.read_only:
            return Availability(
                False,
                f"{where} is on a read-only mount ({mount.mount_point}, "
                f"{mount.fstype} from {mount.device})",
            )
        if not os.access(real, os.W_OK | os.X_OK):
            return Availability(False, f"{where} is not writable by this process")
        return Availability(True)
