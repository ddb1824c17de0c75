"""The ``systemd`` supervisor against a real systemd (a user manager, see usersystemd.py):
the shared conformance suite of the supervisor seam (`kibotos.testing.supervisor_suite`),
then what only systemd does: unit properties on D-Bus, its view of the unit (MainPID,
ControlGroup, InvocationID, Result), the cgroup that `stop` empties, unit names.

Every wait is a poll under a generous deadline; nothing asserts how long anything took.
Per TESTBED.md the effective LimitMEMLOCK (clamped without CAP_SYS_RESOURCE) and OOM
kills cannot be produced here: for those the unit property is asserted.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import trio
from kibotos_systemd.supervisor import SystemdSupervisor
from systemd_helpers import Raw, new_supervisor
from usersystemd import UserSystemd

from kibotos.backends import Supervisor, UnitInfo, UnitSpec
from kibotos.core.errors import AlreadyExists, FailedPrecondition
from kibotos.testing.conformance import BackendFactory, check_id
from kibotos.testing.supervisor_suite import SUPERVISOR_CHECKS, SupervisorCheck
from kibotos.testing.waiting import wait_until

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.systemd]

DEADLINE = 60
INFINITY = 2**64 - 1
MANAGER = ("/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager")


async def wait_inactive(sup: Supervisor, name: str) -> UnitInfo | None:
    async def settled() -> tuple[UnitInfo | None] | None:
        info = await sup.describe(name)
        return (info,) if info is None or not info.active else None

    (info,) = await wait_until(settled, f"{name} inactive")
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


# ---------------------------------------------------------------------------- the suite


@pytest.mark.parametrize("check", SUPERVISOR_CHECKS, ids=check_id)
async def test_conformance(check: SupervisorCheck, user_systemd: UserSystemd,
                           tmp_path: Path) -> None:
    await check(BackendFactory(SystemdSupervisor, {"bus": user_systemd.bus}), tmp_path)


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
    text = await wait_until(lambda: log.exists() and "err" in log.read_text() and log.read_text(),
                            "log lines")
    assert "out hello" in text
    assert info.cgroup is not None
    assert info.cgroup.endswith("/kibotos.slice/kibotos-vmm.slice/kibotos-vmm-props.service")


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
    # (The suite checks the /proc facts.)  Its cgroup is systemd's, and systemd is the
    # parent, not us.
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
    assert dead.result == "signal"  # (the suite checks the rest of an ended unit)
    assert dead.cgroup is None
    assert raw.props("victim.service", "Unit")["ActiveState"] == "failed"
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
    await wait_until(ready.exists, "child started")
    await wait_until(lambda: len(cgroup_procs(cgroup)) == 2, "two processes")
    os.kill(info.main_pid, signal.SIGKILL)
    await wait_until(lambda: not cgroup_procs(cgroup), "the child ended with the unit")
    ended = await wait_inactive(sup, "parent")
    assert ended is not None
    assert ended.result == "signal"


# ---------------------------------------------------------------------------- stop


async def test_stop_kills_children_that_ignore_sigterm_and_left_the_group(sup, tmp_path):
    ready = tmp_path / "ready"
    # SIG_IGN is inherited across fork and exec: every process here ignores SIGTERM,
    # and one child is in its own session, out of the unit's process group.
    script = (f'trap "" TERM; sleep 1000 & setsid sleep 1000 & touch {ready}; '
              "wait; wait")
    info = await sup.start(UnitSpec(name="stubborn", argv=["sh", "-c", script]))
    assert info.cgroup is not None
    await wait_until(ready.exists, "children started")
    cgroup = info.cgroup
    members = await wait_until(lambda: len(cgroup_procs(cgroup)) == 3 and cgroup_procs(cgroup),
                               "three processes in the unit's cgroup")
    with trio.fail_after(DEADLINE):
        await sup.stop("stubborn", timeout=0.5)
    assert cgroup_procs(cgroup) == set()
    assert not any(alive(p) for p in members)
    assert await sup.describe("stubborn") is None


# ---------------------------------------------------------------------------- list, adopt


async def test_list_shows_only_transient_services(sup, user_systemd, raw: Raw):
    """(The suite checks listing and adoption by a new supervisor.)  Of systemd's units,
    `list` shows the transient services kibotos started, not systemd's own."""
    await sup.start(UnitSpec(name="kibotos-vmm-a.service", argv=["sleep", "1000"]))
    await sup.start(UnitSpec(name="kibotos-egress-s-1.service", argv=["sleep", "1000"],
                             properties={"Slice": "kibotos-egress.slice"}))
    names = [i.name for i in await new_supervisor(user_systemd).list("")]
    assert names == ["kibotos-egress-s-1.service", "kibotos-vmm-a.service"]
    assert raw.unit_path("dbus.socket") is not None


# ---------------------------------------------------------------------------- refusals


async def test_starting_an_active_unit_is_refused(sup):
    info = await sup.start(UnitSpec(name="single", argv=["sleep", "1000"]))
    message = f"unit single.service is already running .PID {info.main_pid}"
    with pytest.raises(AlreadyExists, match=message):
        await sup.start(UnitSpec(name="single.service", argv=["sleep", "1000"]))
    assert await sup.describe("single") == info


async def test_a_command_that_cannot_run_leaves_no_unit_in_systemd(sup, raw: Raw):
    with pytest.raises(FailedPrecondition, match="cannot execute 'no-such-binary-kibotos'"):
        await sup.start(UnitSpec(name="missing", argv=["no-such-binary-kibotos"]))
    assert raw.unit_path("missing.service") is None


async def test_a_failing_setup_step_is_named(sup, raw: Raw, tmp_path):
    with pytest.raises(FailedPrecondition, match="step CHDIR"):
        await sup.start(UnitSpec(name="nowhere", argv=["sleep", "1000"],
                                 working_directory=tmp_path / "absent"))
    assert raw.unit_path("nowhere.service") is None

