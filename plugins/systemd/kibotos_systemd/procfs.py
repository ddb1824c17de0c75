"""What /proc says about a unit's main process: the facts that identify it.

systemd tells the MainPID and the cgroup (``ControlGroup``); the process's start time,
executable file and network namespace come from ``/proc/<pid>``, as with the ``direct``
supervisor (this plugin keeps its own reader: a built-in plugin uses only the core's
public API, and either plugin may be blocked).  Every reader returns None for a process
that is gone: a process can exit between any two reads.  The cgroup readers list a
unit's processes straight from the cgroup file system, which is how `stop` knows the
unit's cgroup is empty.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

_CLK_TCK = os.sysconf("SC_CLK_TCK")
#: States of a process that has exited and only waits to be reaped.
DEAD_STATES = frozenset("ZXx")


@dataclass(frozen=True)
class ProcessFacts:
    start_time_ticks: int  # field 22 of /proc/<pid>/stat: clock ticks after boot
    executable: str | None
    executable_dev_ino: tuple[int, int] | None
    netns_inode: int | None


def stat_fields(pid: int, proc: Path = Path("/proc")) -> list[str] | None:
    """Fields 3… of ``/proc/<pid>/stat`` (found after the *last* ``)``: the command
    name may hold spaces and parentheses), or None when the process is gone."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    _, sep, rest = text.rpartition(")")
    fields = rest.split()
    return fields if sep and len(fields) > 19 else None


def start_time(pid: int, proc: Path = Path("/proc")) -> int | None:
    """Field 22 of a live (not zombie) process, or None."""
    fields = stat_fields(pid, proc)
    if fields is None or fields[0] in DEAD_STATES:
        return None
    return int(fields[19])


def facts(pid: int, proc: Path = Path("/proc")) -> ProcessFacts | None:
    """Every identity fact of `pid`, or None when it is gone (or a zombie)."""
    started = start_time(pid, proc)
    if started is None:
        return None
    link = proc / str(pid) / "exe"
    try:
        exe_path: str | None = os.readlink(link)
        st = os.stat(link)
        dev_ino: tuple[int, int] | None = (st.st_dev, st.st_ino)
    except OSError:
        exe_path, dev_ino = None, None
    try:
        netns: int | None = os.stat(proc / str(pid) / "ns" / "net").st_ino
    except OSError:
        netns = None
    return ProcessFacts(started, exe_path, dev_ino, netns)


def cgroup_mounts(proc: Path = Path("/proc")) -> list[Path]:
    """Where the hierarchies systemd tracks units in are mounted: cgroup v2, and on a
    v1 or hybrid host also v1's ``name=systemd``."""
    mounts = []
    try:
        text = (proc / "self" / "mountinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields = right.split()
        if len(fields) < 3:
            continue
        if fields[0] == "cgroup2" or (
                fields[0] == "cgroup" and "name=systemd" in fields[2].split(",")):
            mounts.append(Path(left.split()[4]))
    return mounts


def cgroup_pids(cgroup: str, proc: Path = Path("/proc")) -> set[int]:
    """Every process in cgroup `cgroup` (a path like systemd's ``ControlGroup``) and
    below it, in any tracked hierarchy; empty when the cgroup no longer exists."""
    pids: set[int] = set()
    relative = cgroup.strip("/")
    if not relative:
        raise ValueError("refusing to list the root cgroup")
    for mount in cgroup_mounts(proc):
        for dirpath, _dirs, files in os.walk(mount / relative):
            if "cgroup.procs" not in files:
                continue
            try:
                text = (Path(dirpath) / "cgroup.procs").read_text()
            except OSError:
                continue  # removed meanwhile
            pids.update(int(p) for p in text.split())
    return pids


def plausible_start(start_ticks: int, exec_start_usec: int) -> bool:
    """Whether a process that started `start_ticks` after boot can be the main process
    systemd forked at ``ExecMainStartTimestampMonotonic`` = `exec_start_usec`.

    /proc counts boot time (which includes suspended time), the timestamp counts
    monotonic time (which does not): the process starts at most the time suspended so
    far after the timestamp, and never before it (a second of slack each way covers
    tick rounding).  A PID that now belongs to a later process fails the upper bound
    unless it was reused within that second, which systemd (the parent, told at once
    by SIGCHLD, resetting MainPID) prevents in practice."""
    if exec_start_usec <= 0:
        return True  # not known (an old systemd): systemd's MainPID is all there is
    started = start_ticks / _CLK_TCK
    exec_start = exec_start_usec / 1e6
    suspended = time.clock_gettime(time.CLOCK_BOOTTIME) - time.clock_gettime(
        time.CLOCK_MONOTONIC)
    return exec_start - 1.0 <= started <= exec_start + suspended + 1.0


def live_cgroup_pids(cgroup: str) -> set[int]:
    """Live (not zombie) processes of `cgroup` and below; empty for the root."""
    if not cgroup.strip("/"):
        return set()
    return {pid for pid in cgroup_pids(cgroup) if start_time(pid) is not None}


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # ended meanwhile
        os.kill(pid, signal.SIGKILL)
