"""The ``direct`` supervisor for real: processes started, described, adopted, stopped.

Every wait is a poll under a generous deadline; nothing asserts how long anything took.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from kibotos.backends import Supervisor, UnitInfo, UnitSpec
from kibotos.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from kibotos.plugins import load_plugins

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


async def wait_for(predicate, what: str):
    with trio.fail_after(DEADLINE):
        while True:
            value = await trio.to_thread.run_sync(predicate)
            if value:
                return value
            await trio.sleep(0.05)
    raise AssertionError(what)  # pragma: no cover


@pytest.fixture
async def sup(tmp_path) -> AsyncIterator[Supervisor]:
    state = tmp_path / "units"
    supervisor = new_supervisor(state)
    yield supervisor
    # Leave nothing running, whatever the test did.
    for info in await new_supervisor(state).list(""):
        await supervisor.stop(info.name, timeout=1)


def check_identity(info: UnitInfo, state_dir: Path) -> None:
    """Every identity fact of a running unit, checked against /proc and its record."""
    assert info.active
    assert info.result is None
    pid = info.main_pid
    assert pid is not None
    assert info.argv == ("sleep", "1000")
    assert info.start_time_ticks == int(stat_fields(pid)[19])  # field 22
    sleep = os.path.realpath(shutil.which("sleep") or "")
    assert info.executable == sleep
    st = os.stat(sleep)
    assert info.executable_dev_ino == (st.st_dev, st.st_ino)
    cgroup_lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    assert f"0::{info.cgroup}" in cgroup_lines
    assert info.netns_inode == os.stat("/proc/self/ns/net").st_ino
    assert info.invocation_id is not None
    assert len(info.invocation_id) == 32
    int(info.invocation_id, 16)
    # Its own session and process group, not our child, told its invocation ID.
    assert os.getsid(pid) == pid
    assert os.getpgid(pid) == pid
    assert int(stat_fields(pid)[1]) != os.getpid()
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"INVOCATION_ID={info.invocation_id}".encode() in environ

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


async def test_start_describes_every_identity_field(sup, tmp_path):
    info = await sup.start(UnitSpec(name="vm-one", argv=["sleep", "1000"]))
    check_identity(info, tmp_path / "units")
    assert await sup.describe("vm-one") == info


async def test_output_goes_to_the_log_file(sup, tmp_path):
    log = tmp_path / "logs" / "chatty.log"
    await sup.start(UnitSpec(
        name="chatty",
        argv=["sh", "-c", 'echo "out $GREETING"; echo err >&2; exec sleep 1000'],
        environment={"GREETING": "hello"},
        log_path=log,
    ))
    text = await wait_for(
        lambda: log.exists() and "err" in log.read_text() and log.read_text(), "log lines"
    )
    assert "out hello" in text
    default = new_supervisor(tmp_path / "other")
    await default.start(UnitSpec(name="quiet", argv=["sh", "-c", "echo here; exec sleep 1000"]))
    default_log = tmp_path / "other" / "logs" / "quiet.log"
    await wait_for(lambda: default_log.exists() and "here" in default_log.read_text(), "log")
    await default.stop("quiet", timeout=5)


async def test_environment_is_not_inherited(sup, tmp_path, monkeypatch):
    monkeypatch.setenv("KIBOTOS_SECRET_OF_THE_NODE", "leak")
    out = tmp_path / "env.txt"
    await sup.start(UnitSpec(
        name="env", argv=["sh", "-c", f"env > {out}.tmp && mv {out}.tmp {out}; exec sleep 1000"],
        working_directory=tmp_path,
    ))
    env = await wait_for(lambda: out.exists() and out.read_text(), "env dump")
    assert "KIBOTOS_SECRET_OF_THE_NODE" not in env
    assert "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in env


async def test_a_recreated_supervisor_lists_and_adopts_units(sup, tmp_path):
    first = await sup.start(UnitSpec(name="vmm-a", argv=["sleep", "1000"]))
    await sup.start(UnitSpec(name="vmm-b", argv=["sleep", "1000"]))
    await sup.start(UnitSpec(name="egress-a", argv=["sleep", "1000"]))
    again = new_supervisor(tmp_path / "units")  # what a restarted node builds
    listed = await again.list("vmm-")
    assert [i.name for i in listed] == ["vmm-a", "vmm-b"]
    assert all(i.active for i in listed)
    assert listed[0] == first
    assert [i.name for i in await again.list("")] == ["egress-a", "vmm-a", "vmm-b"]
    assert await again.list("nothing") == []
    await again.stop("vmm-a", timeout=5)
    assert await sup.describe("vmm-a") is None


async def test_units_survive_the_node_process(tmp_path):
    """A separate "node" process starts a unit and is killed with SIGKILL: the unit
    lives on, and this process (a new node) finds it."""
    state = tmp_path / "units"
    script = textwrap.dedent(f"""
        import json, sys, trio
        from kibotos.backends import UnitSpec
        from kibotos.plugins import load_plugins

        async def main():
            sup = load_plugins().supervisor.get("direct")({{"state_dir": {str(state)!r}}})
            info = await sup.start(UnitSpec(name="orphan", argv=["sleep", "1000"]))
            print(json.dumps(info.main_pid), flush=True)
            await trio.sleep_forever()

        trio.run(main)
    """)
    node = spawn([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                 start_new_session=True)
    try:
        assert node.stdout is not None
        line = await trio.to_thread.run_sync(node.stdout.readline)
        pid = json.loads(line)
    finally:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()
        if node.stdout is not None:
            node.stdout.close()
    sup = new_supervisor(state)
    try:
        info = await sup.describe("orphan")
        assert info is not None
        assert info.active
        assert info.main_pid == pid
        assert int(stat_fields(pid)[1]) != node.pid
    finally:
        await sup.stop("orphan", timeout=5)


async def test_kill_9_makes_the_unit_inactive(sup):
    info = await sup.start(UnitSpec(name="victim", argv=["sleep", "1000"]))
    assert info.main_pid is not None
    os.kill(info.main_pid, signal.SIGKILL)

    async def inactive() -> UnitInfo:
        with trio.fail_after(DEADLINE):
            while True:
                now = await sup.describe("victim")
                assert now is not None
                if not now.active:
                    return now
                await trio.sleep(0.05)

    dead = await inactive()
    assert dead.result == "gone"
    assert dead.main_pid is None
    assert dead.start_time_ticks is None
    assert dead.invocation_id == info.invocation_id
    assert [i.active for i in await sup.list("victim")] == [False]
    # A dead unit's name may be started again, with a new invocation.
    again = await sup.start(UnitSpec(name="victim", argv=["sleep", "1000"]))
    assert again.active
    assert again.invocation_id != info.invocation_id


async def test_stop_uses_sigterm_first(sup, tmp_path):
    marker = tmp_path / "terminated"
    ready = tmp_path / "ready"
    code = textwrap.dedent(f"""
        import signal, sys, time, pathlib
        def term(*_):
            pathlib.Path({str(marker)!r}).write_text("SIGTERM")
            sys.exit(0)
        signal.signal(signal.SIGTERM, term)
        pathlib.Path({str(ready)!r}).write_text("")
        while True:
            time.sleep(1)
    """)
    await sup.start(UnitSpec(name="polite", argv=[sys.executable, "-c", code]))
    await wait_for(ready.exists, "handler installed")
    await sup.stop("polite", timeout=DEADLINE)
    assert marker.read_text() == "SIGTERM"
    assert await sup.describe("polite") is None


async def test_stop_kills_a_group_that_ignores_sigterm(sup, tmp_path):
    ready = tmp_path / "ready"
    script = f'trap "" TERM; sleep 1000 & sleep 1000 & touch {ready}; wait; wait'
    info = await sup.start(UnitSpec(name="stubborn", argv=["sh", "-c", script]))
    pgrp = info.main_pid
    assert pgrp is not None
    await wait_for(ready.exists, "children started")
    assert len(group_alive(pgrp)) == 3
    with trio.fail_after(DEADLINE):
        await sup.stop("stubborn", timeout=0.5)
    assert group_alive(pgrp) == []
    assert await sup.describe("stubborn") is None
    assert not (tmp_path / "units" / "stubborn.json").exists()


async def test_stop_of_an_unknown_unit_is_a_no_op(sup):
    await sup.stop("never-started", timeout=1)
    assert await sup.describe("never-started") is None


async def test_leftovers_of_a_dead_unit_go_when_its_name_is_reused(sup, tmp_path):
    ready = tmp_path / "ready"
    info = await sup.start(UnitSpec(
        name="parent", argv=["sh", "-c", f"sleep 1000 & touch {ready}; wait"]))
    await wait_for(ready.exists, "child started")
    assert info.main_pid is not None
    os.kill(info.main_pid, signal.SIGKILL)  # the main process dies, its child stays
    await wait_for(lambda: len(group_alive(info.main_pid)) == 1, "only the child left")
    again = await sup.start(UnitSpec(name="parent", argv=["sleep", "1000"]))
    assert again.active
    assert group_alive(info.main_pid) == []


async def test_starting_an_active_unit_is_refused(sup):
    info = await sup.start(UnitSpec(name="single", argv=["sleep", "1000"]))
    with pytest.raises(AlreadyExists, match=f"unit single is already running .PID {info.main_pid}"):
        await sup.start(UnitSpec(name="single", argv=["sleep", "1000"]))
    assert await sup.describe("single") == info


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
        await wait_for(lambda pid=pid: not group_alive(pid), "unit gone")
        await wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists(), "reaped")
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


async def test_a_command_that_cannot_run_is_refused_and_leaves_no_record(sup, tmp_path):
    with pytest.raises(FailedPrecondition, match="cannot execute 'no-such-binary-kibotos'"):
        await sup.start(UnitSpec(name="missing", argv=["no-such-binary-kibotos"]))
    assert await sup.describe("missing") is None
    assert not (tmp_path / "units" / "missing.json").exists()


async def test_a_unit_that_exits_at_once_is_inactive(sup):
    info = await sup.start(UnitSpec(name="brief", argv=["true"]))
    assert info.invocation_id is not None

    async def settled():
        with trio.fail_after(DEADLINE):
            while (now := await sup.describe("brief")) is not None and now.active:
                await trio.sleep(0.05)
            return now

    now = await settled()
    assert now is not None
    assert now.result == "gone"


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "x" * 201, "sp ace"])
async def test_bad_unit_names_are_refused(sup, name):
    with pytest.raises(InvalidArgument, match="invalid unit name"):
        await sup.start(UnitSpec(name=name, argv=["true"]))
    with pytest.raises(InvalidArgument, match="invalid unit name"):
        await sup.describe(name)


async def test_empty_argv_is_refused(sup):
    with pytest.raises(InvalidArgument, match="argv is empty"):
        await sup.start(UnitSpec(name="empty", argv=[]))


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
