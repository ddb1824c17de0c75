"""What ``/proc`` says, read in one place: process status lines, boot facts, mount tables.

The node, its checks, the dev cluster and the ``direct``, ``systemd``, ``local``,
``nfs``, ``firecracker`` and ``qemu`` plugins (through `kibotos.sdk.procfs`) all read
the same few kernel files.  Each had its own parser, and they disagreed in small ways:
one found the fields of ``/proc/<pid>/stat`` after the first ``)`` instead of the last
(a command name may hold parentheses), one decoded the mount table's octal escapes with
``str.isdigit`` (which accepts 8 and 9), one did not decode them at all (a pool path
with a space was then on no mount).  This module is the one reader.

Standard library only and cheap to import: the ``direct`` supervisor's launcher imports
it in a fresh interpreter for every unit start.  Every reader takes ``proc`` (default
``/proc``) so tests point it at a prepared tree.  Process readers return None for a
process that is gone, or a fact that cannot be read, instead of raising: a process can
exit between any two reads and callers treat "gone" as a normal answer.  The mount
table readers raise `OSError`: the table of this process always exists, so failing to
read it is a real error for the caller to report.  Paths are decoded as the OS decodes
file names (`os.fsdecode`), so a mount point compares equal to `os.path.realpath` of
the same directory whatever bytes its name holds.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol, TypeVar

PROC = Path("/proc")
#: Process states of a process that has exited and only waits to be reaped (or is being).
DEAD_STATES = frozenset("ZXx")
#: Clock ticks per second: the unit of the times in ``/proc/<pid>/stat``.
CLK_TCK = os.sysconf("SC_CLK_TCK")
#: Linux capability names in their numbering (linux/capability.h): the bits of the
#: ``Cap*`` masks of ``/proc/<pid>/status``, and of the capability-set unit properties.
CAPABILITIES: tuple[str, ...] = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
    "CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW",
    "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ",
    "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
)

# ---------------------------------------------------------------------------- processes


@dataclass(frozen=True)
class Stat:
    """The fields of ``/proc/<pid>/stat`` kibotos uses (proc(5), 1-based numbers)."""

    pid: int  # field 1
    comm: str  # field 2, without its parentheses
    state: str  # field 3
    ppid: int  # field 4
    pgrp: int  # field 5
    session: int  # field 6
    utime: int  # field 14: clock ticks in user mode
    stime: int  # field 15: clock ticks in kernel mode
    start_time_ticks: int  # field 22: clock ticks after boot

    @property
    def dead(self) -> bool:
        """Exited (a zombie, or being reaped): it holds nothing but its PID."""
        return self.state in DEAD_STATES


def parse_stat(text: str) -> Stat:
    """Parse one ``/proc/<pid>/stat`` line; `ValueError` if it is not one.

    The command name (field 2) may hold spaces and parentheses, so the fields after it
    are found from the *last* closing parenthesis."""
    head, sep, rest = text.rpartition(")")
    pid, paren, comm = head.partition(" (")
    fields = rest.split()
    if not sep or not paren or len(fields) < 20:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    # rest starts at field 3, so field N is fields[N - 3].
    return Stat(pid=int(pid), comm=comm, state=fields[0], ppid=int(fields[1]),
                pgrp=int(fields[2]), session=int(fields[3]), utime=int(fields[11]),
                stime=int(fields[12]), start_time_ticks=int(fields[19]))


def read_stat(pid: int, proc: Path = PROC) -> Stat | None:
    """The status of `pid`; None when it is gone (or the line cannot be read)."""
    try:
        return parse_stat((proc / str(pid) / "stat").read_text(errors="replace"))
    except (OSError, ValueError):
        return None


def start_time(pid: int, proc: Path = PROC) -> int | None:
    """Field 22 of `pid` while it lives (not a zombie), else None."""
    stat = read_stat(pid, proc)
    return None if stat is None or stat.dead else stat.start_time_ticks


def pids(proc: Path = PROC) -> list[int]:
    """Every process ID ``/proc`` lists (some may be gone by the time they are read)."""
    try:
        return sorted(int(name) for name in os.listdir(proc) if name.isdigit())
    except OSError:
        return []


def live_group_members(pgrp: int, proc: Path = PROC) -> list[int]:
    """PIDs of the processes of group `pgrp` that have not exited (zombies excluded:
    they hold nothing but a PID, and on a host whose init does not reap they would
    never go away)."""
    found = []
    for pid in pids(proc):
        stat = read_stat(pid, proc)
        if stat is not None and stat.pgrp == pgrp and not stat.dead:
            found.append(stat.pid)
    return found


def executable(pid: int, proc: Path = PROC) -> tuple[str, tuple[int, int]] | None:
    """The executable's path and ``(st_dev, st_ino)``; the pair still names the file the
    process runs after the path was replaced (an upgrade) or deleted."""
    link = proc / str(pid) / "exe"
    try:
        path = os.readlink(link)
        st = os.stat(link)
    except OSError:
        return None
    return path, (st.st_dev, st.st_ino)


def netns_inode(pid: int, proc: Path = PROC) -> int | None:
    """The inode of the network namespace `pid` is in."""
    try:
        return os.stat(proc / str(pid) / "ns" / "net").st_ino
    except OSError:
        return None


def cgroup(pid: int, proc: Path = PROC) -> str | None:
    """The unified (v2) cgroup path of `pid`; on a v1-only host, the whole membership
    text joined with ``;``."""
    try:
        text = (proc / str(pid) / "cgroup").read_text(errors="replace")
    except OSError:
        return None
    lines = [line for line in text.splitlines() if line]
    for line in lines:
        if line.startswith("0::"):
            return line[3:]
    return ";".join(lines) or None


# ---------------------------------------------------------------------------- boot


def boot_id(proc: Path = PROC) -> str | None:
    """This boot's ID: PIDs and start times only identify a process within one boot."""
    try:
        return (proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return None


def _system_stat(proc: Path) -> list[list[str]]:
    try:
        text = (proc / "stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return []
    return [line.split() for line in text.splitlines()]


def boot_time(proc: Path = PROC) -> float | None:
    """When this host booted (``btime`` of ``/proc/stat``, whole seconds since the
    epoch): a start time in ticks plus this is a wall-clock time."""
    for fields in _system_stat(proc):
        if fields[:1] == ["btime"] and len(fields) > 1:
            try:
                return float(fields[1])
            except ValueError:
                return None
    return None


def cpu_times(proc: Path = PROC) -> tuple[int, int] | None:
    """``(idle, total)`` clock ticks of the aggregate ``cpu`` line of ``/proc/stat``.
    Idle includes iowait; guest time is already inside user and nice, so it is not
    added again."""
    for fields in _system_stat(proc):
        if fields[:1] == ["cpu"]:
            try:
                numbers = [int(x) for x in fields[1:9]]
            except ValueError:
                return None
            if len(numbers) < 4:
                return None
            idle = numbers[3] + (numbers[4] if len(numbers) > 4 else 0)
            return idle, sum(numbers)
    return None


# ---------------------------------------------------------------------------- mounts

_OCTAL = re.compile(r"\\([0-7]{3})")


def unescape(field: str) -> str:
    """A mount table field as it is: the kernel writes space, tab, newline and backslash
    as ``\\ooo`` (octal) so that fields stay separated by spaces."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def _read_table(path: Path) -> str:
    return os.fsdecode(path.read_bytes())


@dataclass(frozen=True)
class Mount:
    """One line of ``/proc/<pid>/mounts``: the options are those in effect, the mount's
    and its super block's together (NFS writes every option it applied there)."""

    device: str
    mount_point: str
    fstype: str
    options: tuple[str, ...]

    @property
    def read_only(self) -> bool:
        return "ro" in self.options

    def has(self, flag: str) -> bool:
        return flag in self.options

    def value(self, key: str) -> str | None:
        """The value of ``key=value`` (the last one wins, as in the kernel's parser)."""
        found = None
        for option in self.options:
            name, sep, value = option.partition("=")
            if sep and name == key:
                found = value
        return found


def parse_mounts(text: str) -> list[Mount]:
    """The ``mounts`` table; malformed lines are skipped, not fatal (the kernel does not
    write them, and one odd line must not hide every mount)."""
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        found.append(Mount(unescape(fields[0]), unescape(fields[1]), fields[2],
                           tuple(fields[3].split(","))))
    return found


def mounts_file(proc: Path = PROC) -> Path:
    """The ``mounts`` table of this process (named in error messages)."""
    return proc / "self" / "mounts"


def read_mounts(proc: Path = PROC) -> list[Mount]:
    """This process's ``mounts`` table; `OSError` when it cannot be read."""
    return parse_mounts(_read_table(mounts_file(proc)))


@dataclass(frozen=True)
class MountInfo:
    """One line of ``/proc/<pid>/mountinfo`` (proc(5)): unlike ``mounts`` it gives the
    mount's device number (``major:minor``) and the root of the mount within its file
    system, and keeps the mount's options apart from its super block's."""

    mount_id: int
    parent_id: int
    device: str  # "major:minor"
    root: str
    mount_point: str
    options: tuple[str, ...]
    fstype: str
    source: str
    super_options: tuple[str, ...]


def parse_mountinfo(text: str) -> list[MountInfo]:
    """The ``mountinfo`` table; malformed lines are skipped, as in `parse_mounts`."""
    found = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, after = left.split(), right.split()
        if not sep or len(fields) < 6 or not after:
            continue
        try:
            ids = int(fields[0]), int(fields[1])
        except ValueError:
            continue
        found.append(MountInfo(
            mount_id=ids[0], parent_id=ids[1], device=fields[2], root=unescape(fields[3]),
            mount_point=unescape(fields[4]), options=tuple(fields[5].split(",")),
            fstype=after[0], source=unescape(after[1]) if len(after) > 1 else "",
            super_options=tuple(after[2].split(",")) if len(after) > 2 else ()))
    return found


def mountinfo_file(proc: Path = PROC) -> Path:
    """The ``mountinfo`` table of this process (named in error messages)."""
    return proc / "self" / "mountinfo"


def read_mountinfo(proc: Path = PROC) -> list[MountInfo]:
    """This process's ``mountinfo`` table; `OSError` when it cannot be read."""
    return parse_mountinfo(_read_table(mountinfo_file(proc)))


class _HasMountPoint(Protocol):
    @property
    def mount_point(self) -> str: ...


M = TypeVar("M", bound=_HasMountPoint)


def _covers(mount_point: str, path: PurePosixPath) -> bool:
    point = PurePosixPath(mount_point)
    return point.is_absolute() and (path == point or point in path.parents)


def find_mount(mounts: Iterable[M], path: Path | str) -> M | None:
    """The mount that holds `path` (give its real path): the longest covering mount
    point, the last one in the table when mounts are stacked, as the kernel resolves
    it."""
    target = PurePosixPath(path)
    best: M | None = None
    depth = -1
    for mount in mounts:
        if _covers(mount.mount_point, target):
            parts = len(PurePosixPath(mount.mount_point).parts)
            if parts >= depth:
                best, depth = mount, parts
    return best


def mounts_under(mounts: Sequence[_HasMountPoint], directory: Path | str) -> list[Path]:
    """Mount points at or below `directory` (give its real path), deepest first: the
    order to unmount them in."""
    found = {Path(m.mount_point) for m in mounts
             if _covers(str(directory), PurePosixPath(m.mount_point))}
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


# ---------------------------------------------------------------------------- cgroups


def cgroup_mounts(proc: Path = PROC) -> list[Path]:
    """Where the hierarchies systemd tracks units in are mounted: cgroup v2, and on a
    v1 or hybrid host also v1's ``name=systemd``.  Empty when the table cannot be read."""
    try:
        table = read_mountinfo(proc)
    except OSError:
        return []
    return [Path(m.mount_point) for m in table
            if m.fstype == "cgroup2" or (m.fstype == "cgroup"
                                         and "name=systemd" in m.super_options)]


def cgroup_pids(cgroup_path: str, proc: Path = PROC) -> set[int]:
    """Every process in cgroup `cgroup_path` (a path like systemd's ``ControlGroup``)
    and below it, in any tracked hierarchy; empty when the cgroup no longer exists.
    `ValueError` for the root cgroup, which would be every process of the host."""
    relative = cgroup_path.strip("/")
    if not relative:
        raise ValueError("refusing to list the root cgroup")
    found: set[int] = set()
    for mount in cgroup_mounts(proc):
        for dirpath, _dirs, files in os.walk(mount / relative):
            if "cgroup.procs" not in files:
                continue
            try:
                text = (Path(dirpath) / "cgroup.procs").read_text()
            except OSError:
                continue  # removed meanwhile
            found.update(int(p) for p in text.split())
    return found
