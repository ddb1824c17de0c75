"""What the ``systemd`` supervisor reads of a unit's processes, beyond what systemd says.

systemd tells the MainPID and the cgroup (``ControlGroup``); the process's start time,
executable file and network namespace come from ``/proc/<pid>`` through the SDK's
reader (`kibotos.sdk.procfs`), as for the ``direct`` supervisor.  Every reader returns
None for a process that is gone: a process can exit between any two reads.  The unit's
processes are listed straight from the cgroup file system (`procfs.cgroup_pids`), which
is how `stop` knows the unit's cgroup is empty.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from kibotos.sdk import procfs


@dataclass(frozen=True)
class ProcessFacts:
    start_time_ticks: int  # field 22 of /proc/<pid>/stat: clock ticks after boot
    executable: str | None
    executable_dev_ino: tuple[int, int] | None
    netns_inode: int | None


def facts(pid: int, proc: Path = procfs.PROC) -> ProcessFacts | None:
    """Every identity fact of `pid`, or None when it is gone (or a zombie)."""
    started = procfs.start_time(pid, proc)
    if started is None:
        return None
    exe = procfs.executable(pid, proc)
    return ProcessFacts(started, exe[0] if exe else None, exe[1] if exe else None,
                        procfs.netns_inode(pid, proc))


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
    started = start_ticks / procfs.CLK_TCK
    exec_start = exec_start_usec / 1e6
    suspended = time.clock_gettime(time.CLOCK_BOOTTIME) - time.clock_gettime(
        time.CLOCK_MONOTONIC)
    return exec_start - 1.0 <= started <= exec_start + suspended + 1.0


def live_cgroup_pids(cgroup: str) -> set[int]:
    """Live (not zombie) processes of `cgroup` and below; empty for the root."""
    if not cgroup.strip("/"):
        return set()
    return {pid for pid in procfs.cgroup_pids(cgroup) if procfs.start_time(pid) is not None}


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # ended meanwhile
        os.kill(pid, signal.SIGKILL)
