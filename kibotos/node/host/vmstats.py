"""CPU and memory of the VMs on this host, read from ``/proc`` of their main processes.

The host-usage sample shows how much of the host the VMs themselves use (beside what
their Allocations promise).  A VMM's main process is the VM (QEMU's vCPU threads are its
threads), so its ``utime + stime`` (fields 14 and 15 of ``/proc/<pid>/stat``) and its
resident set (``/proc/<pid>/statm``) are the VM's.  CPU is a rate, so it needs two
readings: a VM seen for the first time counts from the next sample on.  A PID is only
read while it still has the start time the launch record holds, so a reused PID never
adds a stranger's usage.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from kibotos.core import procfs

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def read_process(proc: Path, pid: int, start_ticks: int) -> tuple[int, int] | None:
    """``(cpu_ticks, rss_bytes)`` of `pid` if it still has `start_ticks`, else None
    (also for a zombie: it has ended and holds nothing but its PID)."""
    stat = procfs.read_stat(pid, proc)
    if stat is None or stat.start_time_ticks != start_ticks or stat.dead:
        return None
    try:
        pages = int((proc / str(pid) / "statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return stat.utime + stat.stime, pages * PAGE_SIZE


class VmUsageMeter:
    """Sums the VMs' usage; keeps the previous CPU reading of each process."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self._previous: dict[tuple[int, int], tuple[int, float]] = {}

    def measure(self, processes: Iterable[tuple[int, int]]) -> tuple[float | None, int]:
        """``(cpu_cores, rss_bytes)`` over `processes` (``(pid, start_ticks)`` pairs);
        cores is None when none of them has a previous reading yet."""
        now = time.monotonic()
        current: dict[tuple[int, int], tuple[int, float]] = {}
        cores: float | None = None
        rss = 0
        for key in processes:
            read = read_process(self.proc, *key)
            if read is None:
                continue
            ticks, resident = read
            rss += resident
            current[key] = (ticks, now)
            before = self._previous.get(key)
            if before is not None and now > before[1]:
                rate = max(0, ticks - before[0]) / procfs.CLK_TCK / (now - before[1])
                cores = (cores or 0.0) + rate
        self._previous = current
        return cores, rss
