"""Host usage from prepared /proc trees: values, None for what cannot be read, and the
10 %/15 % memory-tight hysteresis."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import trio
from node_helpers import write_proc

from kibotos.core import procfs
from kibotos.node.host.usage import (
    MemoryTightness,
    Pressure,
    UsageSampler,
    read_meminfo,
    read_pressure,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_full_sample(tmp_path: Path) -> None:
    proc = write_proc(tmp_path / "proc", available_kb=6_000_000, total_kb=8_000_000)
    sampler = UsageSampler(proc, now=lambda: T0)
    sample, flipped = sampler.sample()
    assert not flipped
    assert sample.memory_available_bytes == 6_000_000 * 1024
    assert sample.memory_total_bytes == 8_000_000 * 1024
    assert sample.memory_tight is False
    assert sample.memory_tight_since is None
    assert sample.cpu_pressure == Pressure(some=0.025, full=0.005)
    assert sample.memory_pressure == Pressure(some=0.10, full=0.04)
    # No VM started on this node: no VM figures.
    assert sample.vm_cpu_cores is None
    assert sample.vm_memory_bytes is None
    # Idle share needs two readings of /proc/stat.
    assert sample.cpu_idle_ratio is None
    assert sampler.latest is sample
    wire = sample.to_wire()
    assert wire["at"] == T0.isoformat()
    assert wire["cpu_pressure"] == {"some": 0.025, "full": 0.005}
    assert set(wire) == {"at", "vm_cpu_cores", "vm_memory_bytes", "memory_available_bytes",
                         "memory_total_bytes", "memory_tight", "memory_tight_since",
                         "cpu_idle_ratio", "cpu_pressure", "memory_pressure"}


def test_cpu_idle_share_between_samples(tmp_path: Path) -> None:
    proc = write_proc(tmp_path / "proc", stat=(100, 0, 100, 800, 0, 0, 0, 0))
    sampler = UsageSampler(proc)
    sampler.sample()
    # +300 user, +100 system, +500 idle, +100 iowait: idle share (500+100)/1000.
    write_proc(proc, stat=(400, 0, 200, 1300, 100, 0, 0, 0))
    assert sampler.sample()[0].cpu_idle_ratio == pytest.approx(0.6)
    # No time passed at all: no share, rather than a made-up one.
    assert sampler.sample()[0].cpu_idle_ratio is None


def test_unreadable_files_are_none_never_zero(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").mkdir()  # reading a directory fails, even as root
    sampler = UsageSampler(proc)
    sampler.sample()
    sample = sampler.sample()[0]
    assert sample.memory_available_bytes is None
    assert sample.memory_total_bytes is None
    assert sample.cpu_idle_ratio is None
    assert sample.cpu_pressure is None
    assert sample.memory_pressure is None
    wire = sample.to_wire()
    assert wire["memory_available_bytes"] is None
    assert wire["cpu_pressure"] is None


def test_partial_files(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal: 1000 kB\nMemFree: 10 kB\n")  # no MemAvailable
    assert read_meminfo(proc) == (None, 1000 * 1024)
    (proc / "stat").write_text("cpu0 1 2 3 4\n")  # no aggregate line
    assert procfs.cpu_times(proc) is None
    (proc / "stat").write_text("cpu  1 x 3 4\n")
    assert procfs.cpu_times(proc) is None
    (proc / "pressure").mkdir()
    # Kernels before 5.13 have no "full" line for cpu.
    (proc / "pressure" / "cpu").write_text("some avg10=0.00 avg60=12.00 avg300=0.00 total=9\n")
    assert read_pressure(proc, "cpu") == Pressure(some=0.12, full=None)
    (proc / "pressure" / "memory").write_text("garbage\n")
    assert read_pressure(proc, "memory") is None


def test_memory_tight_hysteresis() -> None:
    tight = MemoryTightness()
    total = 1000
    steps = [
        (200, False, False),   # 20 %: fine
        (100, False, False),   # exactly 10 %: not below
        (99, True, True),      # below 10 %: tight
        (120, False, True),    # 12 %: stays tight
        (150, False, True),    # exactly 15 %: not above, stays tight
        (151, True, False),    # above 15 %: clears
        (120, False, False),   # 12 % from above: stays clear
    ]
    since_when_tight = None
    for i, (available, flips, is_tight) in enumerate(steps):
        now = T0 + timedelta(seconds=10 * i)
        assert tight.update(available, total, now) is flips, (i, available)
        assert tight.tight is is_tight, (i, available)
        if flips and is_tight:
            since_when_tight = now
        assert tight.since == (since_when_tight if is_tight else None)


def test_unknown_memory_keeps_the_state() -> None:
    tight = MemoryTightness()
    tight.update(50, 1000, T0)
    assert tight.update(None, 1000, T0) is False
    assert tight.update(None, None, T0) is False
    assert tight.tight is True
    assert tight.since == T0


class _Vms:
    def vm_usage(self) -> tuple[float | None, int | None]:
        return 1.5, 3 * 2**30


def test_vm_figures_come_from_the_source(tmp_path: Path) -> None:
    sample = UsageSampler(write_proc(tmp_path / "proc"), _Vms()).sample()[0]
    assert (sample.vm_cpu_cores, sample.vm_memory_bytes) == (1.5, 3 * 2**30)


async def test_run_reports_flips_at_once(tmp_path: Path) -> None:
    proc = write_proc(tmp_path / "proc", available_kb=5000, total_kb=10000)
    sampler = UsageSampler(proc)
    flips: list[bool] = []
    changed = trio.Event()

    def on_change() -> None:
        flips.append(sampler.tightness.tight)
        changed.set()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: sampler.run(
                on_change, interval=0.01, task_status=task_status))
            assert sampler.latest is not None  # the first sample precedes `started`
            write_proc(proc, available_kb=500, total_kb=10000)
            await changed.wait()
            changed = trio.Event()
            write_proc(proc, available_kb=2000, total_kb=10000)
            await changed.wait()
            nursery.cancel_scope.cancel()
    assert flips == [True, False]
