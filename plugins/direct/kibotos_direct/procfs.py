"""What /proc says about one process: the facts that identify it across PID reuse.

Standard library only, because the launcher (`kibotos_direct.launch`) imports it in a
fresh interpreter for every unit start.  Every reader returns None for a process that
is gone (or a fact that cannot be read) instead of raising: a process can exit between
any two reads, and callers treat "gone" as a normal answer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
#: States of a process that has exited and only waits to be reaped (or is being).
DEAD_STATES = frozenset("ZXx")


@dataclass(frozen=True)
class Stat:
    """The fields of ``/proc/<pid>/stat`` the supervisor uses (1-based field numbers)."""

    pid: int
    state: str  # field 3
    pgrp: int  # field 5
    session: int  # field 6
    start_time_ticks: int  # field 22: clock ticks after boot

    @property
    def dead(self) -> bool:
        return self.state in DEAD_STATES


def parse_stat(text: str) -> Stat:
    """Parse a stat line; the command name (field 2) may hold spaces and parentheses, so
    the fields after it are found from the *last* closing parenthesis."""
    head, sep, rest = text.rpartition(")")
    if not sep:
        raise ValueError(f"malformed stat line: {text[:80]!r}")
    fields = rest.split()
    # rest starts at field 3, so field N is fields[N - 3].
    return Stat(
        pid=int(head.split("(", 1)[0]),
        state=fields[0],
        pgrp=int(fields[2]),
        session=int(fields[3]),
        start_time_ticks=int(fields[19]),
    )


def read_stat(pid: int, proc: Path = PROC) -> Stat | None:
    try:
        return parse_stat((proc / str(pid) / "stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


def boot_id(proc: Path = PROC) -> str | None:
    """This boot's ID: PIDs and start times only identify a process within one boot."""
    try:
        return (proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return None


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


def cgroup(pid: int, proc: Path = PROC) -> str | None:
    """The unified (v2) cgroup path; on a v1-only host, the whole membership text."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    lines = [line for line in text.splitlines() if line]
    for line in lines:
        if line.startswith("0::"):
            return line[3:]
    return ";".join(lines) or None


def netns_inode(pid: int, proc: Path = PROC) -> int | None:
    try:
        return os.stat(proc / str(pid) / "ns" / "net").st_ino
    except OSError:
        return None


def identity(pid: int, proc: Path = PROC) -> dict[str, object]:
    """Every identity fact of `pid` as a JSON-ready dict (None where unreadable)."""
    stat = read_stat(pid, proc)
    exe = executable(pid, proc)
    return {
        "main_pid": pid,
        "start_time_ticks": stat.start_time_ticks if stat else None,
        "executable": exe[0] if exe else None,
        "executable_dev_ino": list(exe[1]) if exe else None,
        "cgroup": cgroup(pid, proc),
        "netns_inode": netns_inode(pid, proc),
        "boot_id": boot_id(proc),
    }


def live_members(pgrp: int, proc: Path = PROC) -> list[int]:
    """PIDs of the processes of group `pgrp` that have not exited (zombies excluded:
    they hold nothing but a PID, and on a host whose init does not reap they would
    never go away)."""
    pids = []
    try:
        entries = os.listdir(proc)
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        stat = read_stat(int(entry), proc)
        if stat is not None and stat.pgrp == pgrp and not stat.dead:
            pids.append(stat.pid)
    return sorted(pids)
