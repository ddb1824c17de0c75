"""Crash-safe file writes: temporary file, fsync, rename, fsync of the directory.

A reader never sees a torn file: it sees the old content or the new.  Temporary files
are dot-files beginning with the writer's `prefix` (the node ID inside a shared pool,
so a node can tell its own leftovers from a neighbour's) and ending in ``.tmp``;
see docs/storage.md for which leftovers are removed at start.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kibotos.core import failpoints
from kibotos.core.errors import FailedPrecondition


def temp_name(target: Path, prefix: str = "") -> Path:
    stem = f"{prefix}." if prefix else ""
    return target.with_name(f".{stem}{target.stem}-{secrets.randbelow(2**32)}.tmp")


def fsync_path(path: Path | str, flags: int = 0) -> None:
    """fsync what `path` names, opened read-only with `flags` added (``O_DIRECTORY``,
    ``O_NOFOLLOW``, ...): the file or directory is durable on return."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fsync_path(path, os.O_DIRECTORY)


def write_bytes(path: Path, data: bytes, *, prefix: str = "", mode: int = 0o644) -> None:
    """Replace `path` with `data` atomically and durably."""
    tmp = temp_name(path, prefix)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        failpoints.hit("atomic.before-fsync")
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    failpoints.hit("atomic.before-rename")
    os.replace(tmp, path)
    failpoints.hit("atomic.after-rename")
    fsync_dir(path.parent)


#: Zero runs at least this long (and aligned to it) become holes in `write_sparse`.
HOLE_PIECE = 64 << 10


def write_sparse(fd: int, data: bytes) -> None:
    """Write `data` at the current offset of `fd`, skipping over pieces that are all
    zero instead of writing them, so a disk image copied this way stays sparse (an ext4
    Template is about one third zeros).  The caller must ``ftruncate`` the file to its
    full length at the end: a trailing hole is not a write."""
    view = memoryview(data)
    for start in range(0, len(view), HOLE_PIECE):
        piece = view[start:start + HOLE_PIECE]
        if len(piece) == HOLE_PIECE and piece.tobytes().count(0) == HOLE_PIECE:
            os.lseek(fd, HOLE_PIECE, os.SEEK_CUR)
            continue
        while piece:
            piece = piece[os.write(fd, piece):]


class SparseFile:
    """A large file written piece by piece (a download, an upload) into a temporary file
    beside `target`, zero pieces skipped so disk images stay sparse, then made durable
    and renamed into place by `commit`.  `discard` removes it unless `commit` ran; it is
    safe to call more than once and after `commit`."""

    def __init__(self, target: Path, *, prefix: str = "", mode: int = 0o644) -> None:
        self.target = target
        self.tmp: Path | None = temp_name(target, prefix)
        self.fd: int | None = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                                      | os.O_CLOEXEC, mode)
        self.size = 0

    def write(self, data: bytes) -> None:
        assert self.fd is not None, "write after commit or discard"
        write_sparse(self.fd, data)
        self.size += len(data)

    def commit(self) -> None:
        assert self.fd is not None, "commit after discard"
        assert self.tmp is not None, "commit after discard"
        os.ftruncate(self.fd, self.size)  # a trailing hole was skipped, not written
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.replace(self.tmp, self.target)
        self.tmp = None
        fsync_dir(self.target.parent)

    def discard(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
            self.tmp = None


def write_json(path: Path, value: Any, *, prefix: str = "", mode: int = 0o644) -> None:
    data = json.dumps(value, indent=2, sort_keys=True).encode() + b"\n"
    write_bytes(path, data, prefix=prefix, mode=mode)


def read_json(path: Path) -> Any:
    """Read a record written by `write_json`; always from disk, never cached."""
    with open(path, "rb") as f:
        return json.loads(f.read())


def read_json_object_if_present(path: Path, unreadable: Callable[[Exception], str],
                                not_object: str) -> dict[str, Any] | None:
    """The record at `path`, a JSON object, or None when there is none.

    The rule every record reader keeps: a missing record is simply absent, while one
    that cannot be read or parsed is `FailedPrecondition` with the reader's own message
    (``unreadable(error)``), and so is one that holds anything but an object
    (`not_object`): a damaged record is for a person to look at, never to be taken for
    an empty one.  What the object must hold is the caller's check.
    """
    try:
        value = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(unreadable(exc)) from None
    if not isinstance(value, dict):
        raise FailedPrecondition(not_object)
    return value
