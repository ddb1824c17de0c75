"""What the agent reads and writes on the guest's own system: files written atomically,
the mount table, and the few libc calls the standard library lacks (mount, syncfs,
prctl), which go through ctypes, imported on the first such call only."""

from __future__ import annotations

import os
import re  # already loaded by json

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

FIFREEZE = 0xC0045877
FITHAW = 0xC0045878
PR_SET_CHILD_SUBREAPER = 36
MS_RDONLY = 1


def write_stream(fd: int, source: Any, chunk: int) -> None:
    """Write all `source` holds (a file object, read `chunk` bytes at a time) to `fd`,
    each piece whole: ``os.write`` may write less than it is given."""
    while True:
        data = source.read(chunk)
        if not data:
            return
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]


def read_boot_id(path: str = "/proc/sys/kernel/random/boot_id") -> str:
    with open(path) as f:
        return f.read().strip()


def read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def atomic_write(path: str, data: bytes, mode: int = 0o644, *, durable: bool = True
                 ) -> None:
    """Temporary file, rename: never a torn file.  `durable` adds the fsyncs (file,
    then directory) that make it survive a crash.  Files configure writes again at
    every boot and every node takeover (hostname, hosts, resolv.conf) skip them: each
    fsync is an ext4 journal commit, tens of milliseconds in a TCG guest on the boot's
    critical path, and a write lost in a crash is redone by the next configure (ext4's
    auto_da_alloc keeps a replaced file from coming back empty)."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}-{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if not durable:
        return
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class MountEntry:
    """One line of /proc/self/mountinfo: where, which device, what type, from what."""

    __slots__ = ("dev", "fs_type", "mount_point", "source")

    def __init__(self, mount_point: str, dev: tuple[int, int], fs_type: str,
                 source: str) -> None:
        self.mount_point = mount_point
        self.dev = dev
        self.fs_type = fs_type
        self.source = source


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def read_mounts(path: str = "/proc/self/mountinfo") -> list[MountEntry]:
    entries = []
    with open(path) as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            major, minor = fields[2].split(":")
            entries.append(MountEntry(_unescape(fields[4]), (int(major), int(minor)),
                                      fields[sep + 1], _unescape(fields[sep + 2])))
    return entries


def mount_at(path: str) -> MountEntry | None:
    """The mount on top of `path`, if `path` is a mount point."""
    found = None
    for entry in read_mounts():
        if entry.mount_point == path:
            found = entry
    return found


_LIBC: Any = None


def libc_call(name: str, *args: Any) -> None:
    """Call a libc function that returns 0 on success; raise OSError from errno."""
    import ctypes

    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    if getattr(_LIBC, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def sys_mount(source: str, target: str, fs_type: str, flags: int, data: str) -> None:
    import ctypes

    libc_call("mount", source.encode(), target.encode(), fs_type.encode(),
              ctypes.c_ulong(flags), data.encode() if data else None)


def syncfs_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        libc_call("syncfs", fd)
    finally:
        os.close(fd)
