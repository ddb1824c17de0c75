"""What ``check-maintenance`` and ``check-upgrade`` share: the report lines, the owner
lock taken without writing, and the read-only views of the host they look at.

Spec (node-and-vmm-processes, "Pre-replacement check", "Checking with the target binary
before replacement", "Previewing with --preview"): the report has three kinds of lines,
``ok:`` (an answer that meets the requirements), ``blocked:`` (an answer that does not:
the exit status is nonzero) and ``pending:`` (no answer yet because the node is still
working; does not change the exit status).  Both checks are read-only: they open the
owner lock file without creating or truncating it (the node writes its PID there; the
check must not), and read records, ``/proc`` and the mount table only.
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kibotos.core import procfs
from kibotos.core.errors import FailedPrecondition

OK, BLOCKED, PENDING, NOTE = "ok", "blocked", "pending", "note"
#: Exit status of a report with a ``blocked:`` line (the CLI's failed-precondition code).
EXIT_BLOCKED = FailedPrecondition.exit_code


@dataclass
class Report:
    lines: list[tuple[str, str]] = field(default_factory=list)

    def ok(self, text: str) -> None:
        self.lines.append((OK, text))

    def blocked(self, text: str) -> None:
        self.lines.append((BLOCKED, text))

    def pending(self, text: str) -> None:
        self.lines.append((PENDING, text))

    def note(self, text: str) -> None:
        self.lines.append((NOTE, text))

    def of(self, kind: str) -> list[str]:
        return [text for k, text in self.lines if k == kind]

    @property
    def exit_code(self) -> int:
        return EXIT_BLOCKED if self.of(BLOCKED) else 0

    def render(self) -> str:
        return "".join(f"{kind}: {text}\n" for kind, text in self.lines)


class RuntimeInUse(Exception):
    """The owner lock is held: a node process runs on this storage root."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"the runtime is already in use: a node process"
                         f"{f' (pid {holder})' if holder else ''} holds the owner lock "
                         f"{path}; stop the node service first")
        self.path = path
        self.holder = holder


class ReadOnlyOwnerLock:
    """``flock`` on ``runtime/node.lock`` through a read-only descriptor: the node
    cannot start while a check holds it, and the file is neither created nor written
    (no file there means no node ever ran on this root: nothing to hold)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def __enter__(self) -> ReadOnlyOwnerLock:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return self
        except OSError as exc:
            raise FailedPrecondition(f"cannot open the owner lock {self.path}: "
                                     f"{exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            try:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RuntimeInUse(self.path, holder) from None
            raise FailedPrecondition(f"cannot lock {self.path}: {exc.strerror}") from None
        self._fd = fd
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ---------------------------------------------------------------------------- /proc


@dataclass(frozen=True)
class Proc:
    pid: int
    session: int
    pgid: int
    cmdline: tuple[str, ...]
    cwd: str | None
    cgroup: str | None


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def processes(proc_root: Path = Path("/proc")) -> list[Proc]:
    """Every process this host shows, as far as it can still be read."""
    found = []
    for pid in procfs.pids(proc_root):
        stat = procfs.read_stat(pid, proc_root)
        if stat is None:
            continue
        entry = proc_root / str(pid)
        raw = _read(entry / "cmdline") or b""
        try:
            cwd: str | None = os.readlink(entry / "cwd")
        except OSError:
            cwd = None
        group = _read(entry / "cgroup") or b""
        cgroup = next((line[3:].decode(errors="replace") for line in group.splitlines()
                       if line.startswith(b"0::")), None)
        found.append(Proc(pid, stat.session, stat.pgrp,
                          tuple(a.decode(errors="replace") for a in raw.split(b"\0") if a),
                          cwd, cgroup))
    return found


def ancestors(proc_root: Path = Path("/proc"), pid: int | None = None) -> set[int]:
    """This process and its ancestors (the shell that runs the check names the
    configuration, which may sit beside the storage root)."""
    out = set()
    pid = os.getpid() if pid is None else pid
    while pid > 0 and pid not in out:
        out.add(pid)
        stat = procfs.read_stat(pid, proc_root)
        if stat is None:
            break
        pid = stat.ppid
    return out


def under(path: str | None, base: Path) -> bool:
    """Whether `path` is `base` or inside it."""
    if not path:
        return False
    text, root = path.rstrip("/") or "/", str(base).rstrip("/")
    return text == root or text.startswith(root + "/")


def mentions(proc: Proc, bases: list[Path]) -> Path | None:
    """The base of `bases` that `proc` works in or names on its command line."""
    for base in bases:
        if under(proc.cwd, base):
            return base
        for arg in proc.cmdline:
            for word in arg.replace("=", " ").split():
                if under(word, base):
                    return base
    return None


# ---------------------------------------------------------------------------- mounts


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str


def mounts(proc_root: Path = Path("/proc")) -> list[Mount]:
    """The mount table this process sees (``self/mountinfo``); empty if unreadable."""
    try:
        table = procfs.read_mountinfo(proc_root)
    except OSError:
        return []
    return [Mount(m.mount_point, m.fstype) for m in table]
