"""Host usage, sampled every 10 s from ``host.proc_root``, and the memory-tight state.

The sample is for people (``kibo node get``, "Host usage") and for one decision: while
host memory is tight the node takes no new Workspaces.  Tight means available memory
below 10 % of the total; it clears only above 15 %, so a host hovering at the line
does not flip every sample.  A flip is reported to ctrl at once (`on_change`).

What cannot be read is ``None`` (shown as ``-``), never 0: a host without PSI has no
pressure figures, and a 0 would claim the host is idle.  VM figures come from a
`VmUsageSource`; until this node has started a VM there is none, so they are ``None``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import trio

from kibotos.core import procfs
from kibotos.core.logs import EventLogger

log = EventLogger()

SAMPLE_INTERVAL = 10.0
TIGHT_BELOW = 0.10
CLEAR_ABOVE = 0.15


@dataclass(frozen=True)
class Pressure:
    """PSI ``avg60`` as shares 0–1; `full` is None where the kernel has no full line."""

    some: float
    full: float | None

    def to_wire(self) -> dict[str, float | None]:
        return {"some": self.some, "full": self.full}


@dataclass(frozen=True)
class UsageSample:
    at: datetime
    vm_cpu_cores: float | None
    vm_memory_bytes: int | None
    memory_available_bytes: int | None
    memory_total_bytes: int | None
    memory_tight: bool
    memory_tight_since: datetime | None
    cpu_idle_ratio: float | None
    cpu_pressure: Pressure | None
    memory_pressure: Pressure | None

    def to_wire(self) -> dict[str, Any]:
        return {
            "at": self.at.isoformat(),
            "vm_cpu_cores": self.vm_cpu_cores,
            "vm_memory_bytes": self.vm_memory_bytes,
            "memory_available_bytes": self.memory_available_bytes,
            "memory_total_bytes": self.memory_total_bytes,
            "memory_tight": self.memory_tight,
            "memory_tight_since": _iso(self.memory_tight_since),
            "cpu_idle_ratio": self.cpu_idle_ratio,
            "cpu_pressure": self.cpu_pressure.to_wire() if self.cpu_pressure else None,
            "memory_pressure": self.memory_pressure.to_wire() if self.memory_pressure else None,
        }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


class VmUsageSource(Protocol):
    """Usage of all VMs on the host; filled in by the Instance manager once it runs VMs."""

    def vm_usage(self) -> tuple[float | None, int | None]:
        """``(vm_cpu_cores, vm_memory_bytes)``, each None when unknown."""


class NoVmUsage:
    """The source of a node that has not started a VM: nothing to report."""

    def vm_usage(self) -> tuple[float | None, int | None]:
        return None, None


# ---------------------------------------------------------------------------- /proc readers


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None


def read_meminfo(proc: Path) -> tuple[int | None, int | None]:
    """``(MemAvailable, MemTotal)`` in bytes."""
    text = _read(proc / "meminfo")
    if text is None:
        return None, None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if key in ("MemAvailable", "MemTotal") and fields and fields[0].isdigit():
            factor = 1024 if len(fields) > 1 and fields[1] == "kB" else 1
            values[key] = int(fields[0]) * factor
    total = values.get("MemTotal")
    return values.get("MemAvailable"), total if total else None


def read_pressure(proc: Path, resource: str) -> Pressure | None:
    """``/proc/pressure/<resource>`` avg60 of the some and full lines, as shares."""
    text = _read(proc / "pressure" / resource)
    if text is None:
        return None
    found: dict[str, float] = {}
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0] not in ("some", "full"):
            continue
        for item in fields[1:]:
            name, _, value = item.partition("=")
            if name == "avg60":
                with contextlib.suppress(ValueError):
                    found[fields[0]] = min(1.0, max(0.0, float(value) / 100.0))
    if "some" not in found:
        return None
    return Pressure(some=found["some"], full=found.get("full"))


# ---------------------------------------------------------------------------- memory tight


class MemoryTightness:
    """The 10 %/15 % hysteresis.  An unreadable reading keeps the current state: not
    knowing is no reason to start or stop refusing Workspaces."""

    def __init__(self) -> None:
        self.tight = False
        self.since: datetime | None = None

    def update(self, available: int | None, total: int | None, now: datetime) -> bool:
        """Feed one reading; True when the state flipped."""
        if available is None or not total:
            return False
        share = available / total
        if not self.tight and share < TIGHT_BELOW:
            self.tight, self.since = True, now
            return True
        if self.tight and share > CLEAR_ABOVE:
            self.tight, self.since = False, None
            return True
        return False


# ---------------------------------------------------------------------------- sampler


class UsageSampler:
    """Takes samples and keeps the latest; `run` takes one every `interval` seconds."""

    def __init__(self, proc_root: Path, vm_source: VmUsageSource | None = None, *,
                 now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.proc_root = proc_root
        self.vm_source: VmUsageSource = vm_source or NoVmUsage()
        self.tightness = MemoryTightness()
        self.latest: UsageSample | None = None
        self._now = now
        self._cpu_prev: tuple[int, int] | None = None

    def _cpu_idle(self) -> float | None:
        current = procfs.cpu_times(self.proc_root)
        previous, self._cpu_prev = self._cpu_prev, current
        if current is None or previous is None:
            return None
        d_idle, d_total = current[0] - previous[0], current[1] - previous[1]
        if d_total <= 0 or d_idle < 0:
            return None
        return min(1.0, d_idle / d_total)

    def sample(self) -> tuple[UsageSample, bool]:
        """One sample, and whether memory tightness flipped with it."""
        at = self._now()
        available, total = read_meminfo(self.proc_root)
        flipped = self.tightness.update(available, total, at)
        vm_cpu, vm_memory = self.vm_source.vm_usage()
        sample = UsageSample(
            at=at,
            vm_cpu_cores=vm_cpu,
            vm_memory_bytes=vm_memory,
            memory_available_bytes=available,
            memory_total_bytes=total,
            memory_tight=self.tightness.tight,
            memory_tight_since=self.tightness.since,
            cpu_idle_ratio=self._cpu_idle(),
            cpu_pressure=read_pressure(self.proc_root, "cpu"),
            memory_pressure=read_pressure(self.proc_root, "memory"),
        )
        self.latest = sample
        if flipped:
            log.warning("memory tight" if sample.memory_tight else "memory no longer tight",
                        available_bytes=available, total_bytes=total)
        return sample, flipped

    def current(self) -> UsageSample:
        """The latest sample, taking one if there is none yet."""
        if self.latest is None:
            return self.sample()[0]
        return self.latest

    async def run(self, on_change: Callable[[], None], *, interval: float = SAMPLE_INTERVAL,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Sample until cancelled; `on_change` is called when memory tightness flips.
        The first sample is taken before `started`, so a report never lacks it."""
        _, flipped = self.sample()
        task_status.started()
        if flipped:
            on_change()
        while True:
            await trio.sleep(interval)
            _, flipped = self.sample()
            if flipped:
                on_change()
