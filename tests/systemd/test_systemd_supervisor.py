"""The ``systemd`` supervisor against a real systemd (a user manager, see usersystemd.py).

Every wait is a poll under a generous deadline; nothing asserts how long anything took.
Per TESTBED.md the effective LimitMEMLOCK (clamped without CAP_SYS_RESOURCE) and OOM
kills cannot be produced here: for those the unit property is asserted.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio
from systemd_helpers import Raw, new_supervisor
from usersystemd import UserSystemd

from kibotos.backends import Supervisor, UnitInfo, UnitSpec
from kibotos.errors import AlreadyExists, FailedPrecondition

pytestmark = [pytest.mark.root, pytest.mark.slow]

DEADLINE = 60
INFINITY = 2**64 - 1
MANAGER = ("/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager")


async def wait_for(predicate, what: str):
    with trio.fail_after(DEADLINE):
        while True:
            value = await trio.to_thread.run_sync(predicate)
            if value:
                return value
            await trio.sleep(0.05)
    raise AssertionError(what)  # pragma: no cover


async def wait_inactive(sup: Supervisor, name: str) -> UnitInfo | None:
    with trio.fail_after(DEADLINE):
        while (info := await sup.describe(name)) is not None and info.active:
            await trio.sleep(0.05)
    return info


def spawn(argv: list[str], **kwargs) -> subprocess.Popen:
    """A process of the test's own (a "node"), not a unit."""
    return subprocess.Popen(argv, **kwargs)


def proc_bytes(pid: int, name: str) -> bytes:
    return Path(f"/proc/{pid}/{name}").read_bytes()


def alive(pid: int) -> bool:
    try:
        return stat_fields(pid)[0] not in "ZXx"
    except OSError:
        return False


def real_which(command: str) -> str:
    return os.path.realpath(shutil.which(command) or "")


def stat_fields(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()


def cgroup_procs(cgroup: str) -> set[int]:
    """Live processes of a cgroup and below, read from the cgroup file system."""
    pids: set[int] = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields = right.split()
        if fields[0] == "cgroup2" or (fields[0] == "cgroup" and "name=systemd" in fields[2]):
            for dirpath, _d, files in os.walk(Path(left.split()[4]) / cgroup.strip("/")):
                if "cgroup.procs" in files:
                    pids |= {int(p) for p in Path(dirpath, "cgroup.procs").read_text().split()}
    return {pid for pid in pids if alive(pid)}


# ---------------------------------------------------------------------------- properties


async def test_every_property_reaches_systemd_and_the_process(sup, raw: Raw, tmp_path,
                                                              netns_holder):
    log = tmp_path / "logs" / "vmm.log"
    netns = f"/proc/{netns_holder.pid}/ns/net"
    spec = UnitSpec(
        name="kibotos-vmm-props.service",
        argv=["sh", "-c", 'echo "out $GREETING"; echo err >&2; exec sleep 1000'],
        properties={
            "Type": "exec", "Restart": "no", "KillMode": "control-group",
            "OOMPolicy": "kill", "Slice": "kibotos-vmm.slice", "LimitMEMLOCK": "infinity",
            "PrivateMounts": False, "OOMScoreAdjust": 700, "NetworkNamespacePath": netns,
            "User": "root", "SupplementaryGroups": ["daemon", "adm"],
            "Description": "kibotos VMM (test)", "SendSIGKILL": "yes",
        },
        environment={"GREETING": "hello", "KIBOTOS_X": "a b=c"},
        working_directory=tmp_path,
        log_path=log,
    )
    info = await sup.start(spec)
    assert info.active

    service = raw.props(spec.name)
    assert service["Type"] == "exec"
    assert service["Restart"] == "no"
    assert service["KillMode"] == "control-group"
    assert service["OOMPolicy"] == "kill"
    assert service["Slice"] == "kibotos-vmm.slice"
    # Both the hard and the soft limit; the effective one is clamped here (TESTBED).
    assert service["LimitMEMLOCK"] == INFINITY
    assert service["LimitMEMLOCKSoft"] == INFINITY
    assert service["PrivateMounts"] is False
    assert service["OOMScoreAdjust"] == 700
    assert service["NetworkNamespacePath"] == netns
    assert service["User"] == "root"
    assert service["SupplementaryGroups"] == ["daemon", "adm"]
    assert service["SendSIGKILL"] is True
    assert service["Environment"] == [
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "GREETING=hello", "KIBOTOS_X=a b=c"]
    assert service["WorkingDirectory"] == str(tmp_path)
    assert service["StandardOutput"] == "append"
    assert service["StandardError"] == "append"
    assert [(e[0], e[1]) for e in service["ExecStart"]] == [("sh", list(spec.argv))]
    unit = raw.props(spec.name, "Unit")
    assert unit["Description"] == "kibotos VMM (test)"
    assert unit["Transient"] is True

    # ... and what the process got from them.
    pid = info.main_pid
    assert pid is not None
    assert proc_bytes(pid, "oom_score_adj").strip() == b"700"
    assert info.netns_inode == os.stat(netns).st_ino != os.stat("/proc/self/ns/net").st_ino
    groups = proc_bytes(pid, "status").decode().split("Groups:")[1].split("\n")[0]
    assert {1, 4} <= {int(g) for g in groups.split()}  # daemon, adm
    assert os.readlink(f"/proc/{pid}/cwd") == str(tmp_path)
    environ = proc_bytes(pid, "environ").split(b"\0")
    assert b"GREETING=hello" in environ
    assert f"INVOCATION_ID={info.invocation_id}".encode() in environ
    text = await wait_for(lambda: log.exists() and "err" in log.read_text() and log.read_text(),
                          "log lines")
    assert "out hello" in text
    assert info.cgroup is not None
    assert info.cgroup.endswith("/kibotos.slice/kibotos-vmm.slice/kibotos-vmm-props.service")


async def test_environment_is_not_inherited(sup, tmp_path, monkeypatch):
    monkeypatch.setenv("KIBOTOS_SECRET_OF_THE_NODE", "leak")
    out = tmp_path / "env.txt"
    await sup.start(UnitSpec(
        name="env", argv=["sh", "-c", f"env > {out}.tmp && mv {out}.tmp {out}; exec sleep 1000"],
    ))
    env = await wait_for(lambda: out.exists() and out.read_text(), "env dump")
    assert "KIBOTOS_SECRET_OF_THE_NODE" not in env
    assert "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in env


# ---------------------------------------------------------------------------- identity


async def test_identity_matches_systemd_and_proc(sup, raw: Raw, user_systemd: UserSystemd):
    info = await sup.start(UnitSpec(name="vm-one", argv=["sleep", "1000"]))
    assert info.active
    assert info.result is None
    assert info.name == "vm-one"
    assert info.argv == ("sleep", "1000")
    pid = info.main_pid
    assert pid is not None

    service = raw.props("vm-one.service")
    unit = raw.props("vm-one.service", "Unit")
    assert service["MainPID"] == pid
    assert service["ControlGroup"] == info.cgroup
    assert bytes(unit["InvocationID"]).hex() == info.invocation_id
    assert len(info.invocation_id or "") == 32
    # /proc agrees: start time, executable, cgroup, network namespace; systemd is the
    # parent, not us.
    assert info.start_time_ticks == int(stat_fields(pid)[19])
    sleep = real_which("sleep")
    assert info.executable == sleep
    st = os.stat(sleep)
    assert info.executable_dev_ino == (st.st_dev, st.st_ino)
    assert info.netns_inode == os.stat("/proc/self/ns/net").st_ino
    assert info.cgroup == f"{user_systemd.cgroup}/app.slice/vm-one.service"
    assert pid in cgroup_procs(info.cgroup)
    assert int(stat_fields(pid)[1]) == user_systemd.pid
    # The invocation ID leads back to the unit: through an alias path, so by its Id.
    (path,) = raw.call(*MANAGER, "GetUnitByInvocationID", "ay",
                       (bytes.fromhex(info.invocation_id or ""),))
    assert raw.props_at(str(path), "Unit")["Id"] == "vm-one.service"
    assert await sup.describe("vm-one") == info
    assert await sup.describe("vm-one.service") == UnitInfo(**{**info.__dict__,
                                                               "name": "vm-one.service"})


async def test_kill_9_of_the_main_pid_is_a_failed_unit(sup, raw: Raw):
    info = await sup.start(UnitSpec(name="victim.service", argv=["sleep", "1000"]))
    assert info.main_pid is not None
    os.kill(info.main_pid, signal.SIGKILL)
    dead = await wait_inactive(sup, "victim.service")
    assert dead is not None
    assert not dead.active
    assert dead.result == "signal"
    assert dead.main_pid is None
    assert dead.start_time_ticks is None
    assert dead.cgroup is None
    assert dead.invocation_id == info.invocation_id
    assert raw.props("victim.service", "Unit")["ActiveState"] == "failed"
    assert [(i.name, i.active) for i in await sup.list("victim")] == [("victim.service", False)]
    # The name of a failed unit can be started again, with a new invocation.
    again = await sup.start(UnitSpec(name="victim.service", argv=["sleep", "1000"]))
    assert again.active
    assert again.invocation_id != info.invocation_id
    # Stopping forgets it: systemd unloads the unit.
    await sup.stop("victim.service", timeout=5)
    assert await sup.describe("victim.service") is None
    assert raw.unit_path("victim.service") is None


async def test_a_unit_that_exits_at_once(sup):
    ok = await sup.start(UnitSpec(name="brief", argv=["true"]))
    assert ok.invocation_id is not None
    assert await wait_inactive(sup, "brief") is None  # success: systemd forgets it
    bad = await sup.start(UnitSpec(name="sad", argv=["sh", "-c", "exit 3"]))
    assert bad.invocation_id is not None
    ended = await wait_inactive(sup, "sad")
    assert ended is not None
    assert ended.result == "exit-code"  # a failure stays until stop


async def test_when_the_main_process_dies_systemd_ends_the_rest(sup, tmp_path):
    """KillMode=control-group: the main process's children do not outlive it (with
    ``direct`` they would, until the name is started again)."""
    ready = tmp_path / "ready"
    info = await sup.start(UnitSpec(
        name="parent", argv=["sh", "-c", f"setsid sleep 1000 & touch {ready}; wait"],
        properties={"KillMode": "control-group"}))
    assert info.main_pid is not None
    assert info.cgroup is not None
    cgroup = info.cgroup
    await wait_for(ready.exists, "child started")
    await wait_for(lambda: len(cgroup_procs(cgroup)) == 2, "two processes")
    os.kill(info.main_pid, signal.SIGKILL)
    await wait_for(lambda: not cgroup_procs(cgroup), "the child ended with the unit")
    ended = await wait_inactive(sup, "parent")
    assert ended is not None
    assert ended.result == "signal"


async def test_units_survive_the_node_process(user_systemd, tmp_path):
    """A separate "node" process starts a unit and is killed with SIGKILL: the unit
    lives on (systemd is its parent), and this process (a new node) finds it."""
    script = textwrap.dedent(f"""
        import json, trio
        from kibotos.backends import UnitSpec
        from kibotos.plugins import load_plugins

        async def main():
            cls = load_plugins().supervisor.get("systemd")
            sup = cls({{"bus": {user_systemd.bus!r}}})
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
    finally:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()
        if node.stdout is not None:
            node.stdout.close()
    pid = int(line)
    sup = new_supervisor(user_systemd)
    try:
        info = await sup.describe("orphan")
        assert info is not None
        assert info.active
        assert info.main_pid == pid
        assert int(stat_fields(pid)[1]) == user_systemd.pid
    finally:
        await sup.stop("orphan", timeout=5)


# ---------------------------------------------------------------------------- stop


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


async def test_stop_kills_children_that_ignore_sigterm_and_left_the_group(sup, tmp_path):
    ready = tmp_path / "ready"
    # SIG_IGN is inherited across fork and exec: every process here ignores SIGTERM,
    # and one child is in its own session, out of the unit's process group.
    script = (f'trap "" TERM; sleep 1000 & setsid sleep 1000 & touch {ready}; '
              "wait; wait")
    info = await sup.start(UnitSpec(name="stubborn", argv=["sh", "-c", script]))
    assert info.cgroup is not None
    await wait_for(ready.exists, "children started")
    cgroup = info.cgroup
    members = await wait_for(lambda: len(cgroup_procs(cgroup)) == 3 and cgroup_procs(cgroup),
                             "three processes in the unit's cgroup")
    with trio.fail_after(DEADLINE):
        await sup.stop("stubborn", timeout=0.5)
    assert cgroup_procs(cgroup) == set()
    assert not any(alive(p) for p in members)
    assert await sup.describe("stubborn") is None


async def test_stop_of_an_unknown_unit_is_a_no_op(sup):
    await sup.stop("never-started", timeout=1)
    assert await sup.describe("never-started") is None


# ---------------------------------------------------------------------------- list, adopt


async def test_a_recreated_supervisor_lists_and_adopts_units(sup, user_systemd, raw: Raw):
    first = await sup.start(UnitSpec(name="kibotos-vmm-a.service", argv=["sleep", "1000"]))
    await sup.start(UnitSpec(name="kibotos-vmm-b.service", argv=["sleep", "1000"]))
    await sup.start(UnitSpec(name="kibotos-egress-s-1.service", argv=["sleep", "1000"],
                             properties={"Slice": "kibotos-egress.slice"}))
    again = new_supervisor(user_systemd)  # what a restarted node builds
    listed = await again.list("kibotos-vmm-")
    assert [i.name for i in listed] == ["kibotos-vmm-a.service", "kibotos-vmm-b.service"]
    assert all(i.active for i in listed)
    assert listed[0] == first
    names = [i.name for i in await again.list("")]
    assert names == ["kibotos-egress-s-1.service", "kibotos-vmm-a.service",
                     "kibotos-vmm-b.service"]  # transient services only: not dbus.service
    assert raw.unit_path("dbus.socket") is not None
    assert await again.list("nothing") == []
    await again.stop("kibotos-vmm-a.service", timeout=5)
    assert await sup.describe("kibotos-vmm-a.service") is None


# ---------------------------------------------------------------------------- refusals


async def test_starting_an_active_unit_is_refused(sup):
    info = await sup.start(UnitSpec(name="single", argv=["sleep", "1000"]))
    message = f"unit single.service is already running .PID {info.main_pid}"
    with pytest.raises(AlreadyExists, match=message):
        await sup.start(UnitSpec(name="single.service", argv=["sleep", "1000"]))
    assert await sup.describe("single") == info


async def test_a_command_that_cannot_run_is_refused_and_leaves_no_unit(sup, raw: Raw):
    with pytest.raises(FailedPrecondition, match="cannot execute 'no-such-binary-kibotos'"):
        await sup.start(UnitSpec(name="missing", argv=["no-such-binary-kibotos"]))
    assert await sup.describe("missing") is None
    assert raw.unit_path("missing.service") is None


async def test_a_failing_setup_step_is_named(sup, raw: Raw, tmp_path):
    with pytest.raises(FailedPrecondition, match="step CHDIR"):
        await sup.start(UnitSpec(name="nowhere", argv=["sleep", "1000"],
                                 working_directory=tmp_path / "absent"))
    assert raw.unit_path("nowhere.service") is None

