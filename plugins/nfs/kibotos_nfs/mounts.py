"""The NFS mount that holds a pool, read from the kernel's mount tables.

``<proc_root>/self/mounts`` gives the options in effect (the kernel writes every NFS
option it applied, including the version it actually uses); ``self/mountinfo`` gives
the mount's device number, which names its writeback device under
``/sys/class/bdi/<major>:<minor>``.  Both are read from `HostPaths.proc_root` so tests
drive the driver with prepared trees.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

_OCTAL = re.compile(r"\\([0-7]{3})")
NFS_TYPES = ("nfs", "nfs4")


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


@dataclass(frozen=True)
class NfsMount:
    device: str
    mount_point: str
    fstype: str
    options: tuple[str, ...]

    def has(self, flag: str) -> bool:
        return flag in self.options

    def value(self, key: str) -> str | None:
        """The value of ``key=value`` (the last one wins, as in the kernel's parser)."""
        found = None
        for opt in self.options:
            name, sep, val = opt.partition("=")
            if sep and name == key:
                found = val
        return found


def parse_mounts(text: str) -> list[NfsMount]:
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        out.append(NfsMount(_unescape(fields[0]), _unescape(fields[1]), fields[2],
                            tuple(fields[3].split(","))))
    return out


def find_mount(mounts: list[NfsMount], path: Path | str) -> NfsMount | None:
    """Longest mount point covering `path`; the last one when stacked."""
    target = PurePosixPath(path)
    best: NfsMount | None = None
    depth = -1
    for m in mounts:
        mp = PurePosixPath(m.mount_point)
        if mp.is_absolute() and (target == mp or mp in target.parents) and \
                len(mp.parts) >= depth:
            best, depth = m, len(mp.parts)
    return best


def mountinfo_device(proc_root: Path, mount_point: str) -> str | None:
    """``major:minor`` of the last mount at `mount_point` in ``self/mountinfo``."""
    try:
        text = (proc_root / "self" / "mountinfo").read_text(errors="replace")
    except OSError:
        return None
    found = None
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 5 and _unescape(fields[4]) == mount_point:
            found = fields[2]
    return found


def device_number(proc_root: Path, mount: NfsMount, path: Path) -> str:
    """The mount's device as ``major:minor``: from mountinfo, else ``stat``."""
    dev = mountinfo_device(proc_root, mount.mount_point)
    if dev is not None and re.fullmatch(r"\d+:\d+", dev):
        return dev
    st_dev = os.stat(path).st_dev
    return f"{os.major(st_dev)}:{os.minor(st_dev)}"
