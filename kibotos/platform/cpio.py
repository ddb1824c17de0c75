"""A writer for the ``newc`` cpio format the kernel unpacks as its initramfs.

Written here rather than by calling ``cpio`` so the archive is reproducible byte for
byte (every entry owned by root, mtime 0, inode numbers in order): the Platform is
cached by the digest of its inputs and its own files are described by digests, so the
same inputs must give the same initramfs.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass, field

from kibotos.core.errors import InvalidArgument

TRAILER = "TRAILER!!!"


@dataclass
class CpioWriter:
    """Collects entries in order and renders one archive; parents must come first."""

    _parts: list[bytes] = field(default_factory=list)
    _names: set[str] = field(default_factory=set)
    _ino: int = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)
               ) -> None:
        name = name.strip("/")
        if not name or name in self._names:
            raise InvalidArgument(f"initramfs entry {name!r} is empty or given twice")
        parent = name.rpartition("/")[0]
        if parent and parent not in self._names:
            raise InvalidArgument(f"initramfs entry {name!r} comes before its directory")
        self._names.add(name)
        nlink = 2 if stat.S_ISDIR(mode) else 1
        self._append(name, mode, data, nlink, rdev)

    def _append(self, name: str, mode: int, data: bytes, nlink: int, rdev: tuple[int, int]
                ) -> None:
        encoded = name.encode() + b"\x00"
        fields = (self._ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdev[0], rdev[1],
                  len(encoded), 0)
        self._ino += 1
        header = b"070701" + b"".join(b"%08X" % f for f in fields)
        self._parts.append(header + encoded + _pad(len(header) + len(encoded)))
        self._parts.append(data + _pad(len(data)))

    def directory(self, name: str, perm: int = 0o755) -> None:
        self._entry(name, stat.S_IFDIR | perm)

    def file(self, name: str, data: bytes, perm: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | perm, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def char_device(self, name: str, major: int, minor: int, perm: int = 0o600) -> None:
        self._entry(name, stat.S_IFCHR | perm, rdev=(major, minor))

    def render(self) -> bytes:
        """The archive with its trailer; the writer can keep collecting afterwards."""
        saved_ino = self._ino
        self._append(TRAILER, 0, b"", 1, (0, 0))
        trailer = self._parts[-2:]
        del self._parts[-2:]
        self._ino = saved_ino
        return b"".join([*self._parts, *trailer])


def _pad(n: int) -> bytes:
    return b"\x00" * (-n % 4)
