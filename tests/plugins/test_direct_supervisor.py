"""The ``direct`` supervisor for real: the shared conformance suite of the supervisor
seam (`kibotos.testing.supervisor_suite`), then what only ``direct`` does: its records,
its own session per unit, PID reuse and boot checks, its options.

Every wait is a poll under a generous deadline; nothing asserts how long anything took.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kibotos_direct.supervisor import DirectSupervisor

from kibotos.backends import Supervisor, UnitInfo, UnitSpec
from kibotos.core.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from kibotos.plugins import load_plugins
from kibotos.testing.conformance import BackendFactory, check_id
from kibotos.testing.supervisor_suite import SUPERVISOR_CHECKS, SupervisorCheck
from kibotos.testing.waiting import wait_until

DEADLINE = 60


def direct_class() -> type:
    return load_plugins().supervisor.get("direct")


def new_supervisor(state_dir: Path) -> Supervisor:
    return direct_class()({"state_dir": str(state_dir)})


def stat_fields(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()  # fields 3…


def spawn(argv: list[str], **kwargs) -> subprocess.Popen:
    """A process of the test's own (not a unit), e.g. a "node" or a PID squatter."""
    return subprocess.Popen(argv, **kwargs)


def group_alive(pgrp: int) -> list[int]:
    """Live (non-zombie) processes of a process group, read straight from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = stat_fields(int(entry))
            except OSError:
                continue
            if int(fields[2]) == pgrp and fields[0] not in "ZXx":
                pids.append(int(entry))
    return pids


@pytest.fixture
async def sup(tmp_path) -> AsyncIterator[Supervisor]:
    state = tmp_path / "units"
    supervisor = new_supervisor(state)
    yield supervisor
    # Leave nothing running, whatever the test did.
    for info in await new_supervisor(state).list(""):
        await supervisor.stop(info.name, timeout=1)


@pytest.mark.parametrize("check", SUPERVISOR_CHECKS, ids=check_id)
async def test_conformance(check: SupervisorCheck, tmp_path: Path) -> None:
    await check(BackendFactory(DirectSupervisor, {"state_dir": str(tmp_path / "units")}),
                tmp_path)


def check_session_and_record(info: UnitInfo, state_dir: Path) -> None:
    pid = info.main_pid
    assert pid is not None
    assert os.getsid(pid) == pid
    assert os.getpgid(pid) == pid
    assert int(stat_fields(pid)[1]) != os.getpid()
    assert f"0::{info.cgroup}" in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    sleep = os.path.realpath(shutil.which("sleep") or "")
    st = os.stat(sleep)
    record = json.loads((state_dir / f"{info.name}.json").read_text())
    assert record["name"] == info.name
    assert record["argv"] == ["sleep", "1000"]
    assert record["main_pid"] == pid
    assert record["start_time_ticks"] == info.start_time_ticks
    assert record["executable"] == sleep
    assert record["executable_dev_ino"] == [st.st_dev, st.st_ino]
    assert record["cgroup"] == info.cgroup
    assert record["netns_inode"] == info.netns_inode
    assert record["invocation_id"] == info.invocation_id
    assert record["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()


async def test_a_unit_is_its_own_session_and_its_record_holds_every_fact(sup, tmp_path):
    """Beyond the suite's identity check: its own session and process group (so `stop`
    can signal the group), not our child, and the record a restarted node reads."""
    info = await sup.start(UnitSpec(name="vm-one", argv=["sleep", "1000"]))
    check_session_and_record(info, tmp_path / "units")
    await sup.stop("vm-one", timeout=5)
    assert not (tmp_path / "units" / "vm-one.json").exists()


async def test_the_default_log_is_in_the_state_dir(tmp_path):
    default = new_supervisor(tmp_path / "other")
    await default.start(UnitSpec(name="quiet", argv=["sh", "-c", "echo here; exec sleep 1000"]))
    try:
        log = tmp_path / "other" / "logs" / "quiet.log"
        await wait_until(lambda: log.exists() and "here" in log.read_text(), "the log line")
    finally:
        await default.stop("quiet", timeout=5)


async def test_direct_cannot_see_how_a_unit_ended(sup):
    """Not the parent of its units, ``direct`` cannot read an exit status: a unit whose
    main process is gone, killed or exited, has the result ``gone``."""
    killed = await sup.start(UnitSpec(name="victim", argv=["sleep", "1000"]))
    await sup.start(UnitSpec(name="brief", argv=["true"]))
    assert killed.main_pid is not None
    os.kill(killed.main_pid, signal.SIGKILL)
    for name in ("victim", "brief"):
        async def ended(name: str = name) -> UnitInfo | None:
            info = await sup.describe(name)
            return info if info is not None and not info.active else None
        assert (await wait_until(ended, f"{name} inactive")).result == "gone"


async def test_a_reused_pid_is_not_the_unit(sup, tmp_path):
    """The record names a live PID whose start time differs (the kernel gave the number
    to another process): the unit is inactive, and stop leaves that process alone."""
    other = spawn(["sleep", "1000"], start_new_session=True)
    try:
        info = await sup.start(UnitSpec(name="reused", argv=["sleep", "1000"]))
        assert info.main_pid is not None
        os.kill(info.main_pid, signal.SIGKILL)
        path = tmp_path / "units" / "reused.json"
        record = json.loads(path.read_text())
        record.update(main_pid=other.pid, process_group=other.pid,
                      start_time_ticks=int(stat_fields(other.pid)[19]) - 1)
        path.write_text(json.dumps(record))
        described = await sup.describe("reused")
        assert described is not None
        assert not described.active
        await sup.stop("reused", timeout=0.5)
        assert other.poll() is None  # not signalled
        assert await sup.describe("reused") is None
    finally:
        other.kill()
        other.wait()


async def test_a_record_from_another_boot_is_inactive(sup, tmp_path):
    info = await sup.start(UnitSpec(name="old-boot", argv=["sleep", "1000"]))
    path = tmp_path / "units" / "old-boot.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "boot_id": "00000000-0000-0000-0000-000000000000"}))
    described = await sup.describe("old-boot")
    assert described is not None
    assert not described.active
    await sup.stop("old-boot", timeout=0.5)
    assert info.main_pid is not None
    assert group_alive(info.main_pid) == [info.main_pid]  # not ours to kill any more
    os.kill(info.main_pid, signal.SIGKILL)


def spawn_at(pid: int) -> subprocess.Popen:
    """Ask the kernel to give the next new process `pid` (it may not, on a busy host)."""
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
    return spawn(["sleep", "1000"])


@pytest.mark.root
async def test_real_pid_reuse_is_detected(sup):
    """Make the kernel hand the unit's PID to a new process (ns_last_pid), then check
    the unit is reported inactive and the newcomer survives stop."""
    if os.geteuid() != 0 or not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("needs root to steer PID allocation")
    for _attempt in range(20):
        info = await sup.start(UnitSpec(name="recycled", argv=["sleep", "1000"]))
        pid = info.main_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await wait_until(lambda pid=pid: not group_alive(pid), "unit gone")
        await wait_until(lambda pid=pid: not Path(f"/proc/{pid}").exists(), "reaped")
        newcomer = spawn_at(pid)
        try:
            if newcomer.pid != pid:
                continue  # another process on the host took it first; try again
            described = await sup.describe("recycled")
            assert described is not None
            assert not described.active
            await sup.stop("recycled", timeout=0.5)
            assert newcomer.poll() is None
            return
        finally:
            newcomer.kill()
            newcomer.wait()
            await sup.stop("recycled", timeout=0.5)
    pytest.skip("could not get the PID reused (a busy host)")


async def test_a_refused_start_leaves_no_record_and_says_why(sup, tmp_path):
    with pytest.raises(FailedPrecondition, match="cannot execute 'no-such-binary-kibotos'"):
        await sup.start(UnitSpec(name="missing", argv=["no-such-binary-kibotos"]))
    assert not (tmp_path / "units" / "missing.json").exists()
    with pytest.raises(InvalidArgument, match="invalid unit name"):
        await sup.start(UnitSpec(name="a/b", argv=["true"]))
    with pytest.raises(InvalidArgument, match="argv is empty"):
        await sup.start(UnitSpec(name="empty", argv=[]))
    await sup.start(UnitSpec(name="single", argv=["sleep", "1000"]))
    with pytest.raises(AlreadyExists, match=r"unit single is already running \(PID \d+"):
        await sup.start(UnitSpec(name="single", argv=["sleep", "1000"]))


def test_options_are_checked(tmp_path):
    cls = direct_class()
    with pytest.raises(InvalidArgument,
                       match=r"^\[supervisor\.direct\] state_dir: required, not given$"):
        cls({})
    with pytest.raises(InvalidArgument, match=r"^\[supervisor\.direct\]: unknown option cgroup "
                       r"\(known: kill_grace, log_dir, python, state_dir\)$"):
        cls({"state_dir": str(tmp_path), "cgroup": "x"})
    assert isinstance(cls({"state_dir": str(tmp_path)}), Supervisor)


async def test_list_of_a_missing_state_dir_is_empty(tmp_path):
    assert await new_supervisor(tmp_path / "absent").list("") == []
