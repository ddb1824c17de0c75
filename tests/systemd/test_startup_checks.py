"""The node's startup checks (`kibotos.node.checks.startup_checks`): without systemd, against
prepared /proc trees, and for real as a unit of a user systemd (usersystemd.py)."""

from __future__ import annotations

import json
import secrets
import sys
import textwrap
from pathlib import Path

import pytest
import trio
from systemd_helpers import new_supervisor

from kibotos.backends import UnitSpec
from kibotos.config import NodeConfig, parse
from kibotos.core.errors import FailedPrecondition
from kibotos.node.checks.startup_checks import check_startup, own_cgroup
from kibotos.node.serve import serve_node

DEADLINE = 60

# ---------------------------------------------------------------------------- no systemd


def test_a_process_systemd_did_not_start_is_not_checked():
    assert check_startup(environ={}) is None
    assert check_startup(environ={"INVOCATION_ID": ""}) is None


def test_a_malformed_invocation_id_is_refused():
    with pytest.raises(FailedPrecondition, match="INVOCATION_ID='nope' is not a systemd"):
        check_startup(environ={"INVOCATION_ID": "nope"})


def test_an_unreachable_bus_is_a_clear_error(tmp_path):
    env = {"INVOCATION_ID": secrets.token_hex(16),
           "DBUS_SYSTEM_BUS_ADDRESS": f"unix:path={tmp_path / 'no-bus'}"}
    with pytest.raises(FailedPrecondition, match="cannot reach systemd on the D-Bus bus"):
        check_startup(environ=env)


def write_cgroup(proc: Path, pid: int, text: str) -> Path:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "cgroup").write_text(text)
    return proc


@pytest.mark.parametrize(("text", "expected"), [
    ("0::/system.slice/kibotos-node.service\n", "/system.slice/kibotos-node.service"),
    # hybrid: systemd tracks in name=systemd when the v2 path is the root
    ("9:name=systemd:/system.slice/kibotos-node.service\n4:memory:/system.slice\n0::/\n",
     "/system.slice/kibotos-node.service"),
    # hybrid with the unified hierarchy in use
    ("9:name=systemd:/system.slice/kibotos-node.service\n"
     "0::/system.slice/kibotos-node.service\n", "/system.slice/kibotos-node.service"),
    ("1:name=systemd:/user.slice\n", "/user.slice"),
    ("", None),
])
def test_own_cgroup_reads_the_hierarchy_systemd_tracks(tmp_path, text, expected):
    proc = write_cgroup(tmp_path / "proc", 42, text)
    assert own_cgroup(proc, 42) == expected


def test_own_cgroup_of_a_missing_process_is_none(tmp_path):
    assert own_cgroup(tmp_path, 42) is None


async def test_serve_node_runs_the_checks_before_touching_state(tmp_path, monkeypatch):
    """The check fails (bogus invocation) before the storage root is even created."""
    root = tmp_path / "root"
    config = parse(NodeConfig, {
        "node": {"id": "node-a", "ctrl_url": "http://127.0.0.1:9"},
        "storage": {"root": str(root)},
        "resources": {"cpu": 1, "memory": "1G"},
    }, "test")
    monkeypatch.setenv("INVOCATION_ID", "not-an-invocation")
    with pytest.raises(FailedPrecondition, match="node startup check"):
        await serve_node(config)
    assert not root.exists()


# ---------------------------------------------------------------------------- real systemd

CHECK = textwrap.dedent("""
    import json, os, sys
    from kibotos.core.errors import KibotosError
    from kibotos.node.checks.startup_checks import check_startup
    try:
        unit = check_startup()
        out = {"ok": True, "unit": unit.unit, "main_pid": unit.main_pid,
               "cgroup": unit.cgroup, "invocation_id": unit.invocation_id,
               "pid": os.getpid()}
    except KibotosError as exc:
        out = {"ok": False, "error": exc.message}
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump(out, f)
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
""")


async def run_check_as_unit(user_systemd, tmp_path: Path, name: str, shell: str) -> dict:
    """Start `shell` (``$CHECK`` runs the check script) as a unit; the check's answer."""
    out = tmp_path / f"{name}.json"
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    sup = new_supervisor(user_systemd)
    check = f"{sys.executable} {script} {out}"
    try:
        await sup.start(UnitSpec(
            name=name, argv=["sh", "-c", shell.replace("$CHECK", check)],
            environment={"DBUS_SYSTEM_BUS_ADDRESS": user_systemd.bus},
            log_path=tmp_path / f"{name}.log"))
        with trio.fail_after(DEADLINE):
            while not out.exists():
                await trio.sleep(0.05)
        return json.loads(out.read_text())
    finally:
        await sup.stop(name, timeout=1)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.systemd
async def test_a_node_that_is_its_units_main_process_passes(user_systemd, tmp_path):
    answer = await run_check_as_unit(user_systemd, tmp_path, "kibotos-node.service",
                                     "exec $CHECK")
    assert answer["ok"], answer
    assert answer["unit"] == "kibotos-node.service"
    assert answer["main_pid"] == answer["pid"]
    assert answer["cgroup"] == f"{user_systemd.cgroup}/app.slice/kibotos-node.service"


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.systemd
async def test_leftover_processes_in_the_cgroup_are_named(user_systemd, tmp_path):
    # A helper of a "previous run", in its own session: still in the unit's cgroup.
    answer = await run_check_as_unit(user_systemd, tmp_path, "kibotos-node.service",
                                     "setsid sleep 1000 & exec $CHECK")
    assert not answer["ok"]
    assert "leftover processes of a previous node run" in answer["error"]
    assert "(sleep 1000)" in answer["error"]
    assert "systemctl stop kibotos-node.service" in answer["error"]


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.systemd
async def test_a_node_behind_a_wrapper_is_not_the_main_pid(user_systemd, tmp_path):
    answer = await run_check_as_unit(user_systemd, tmp_path, "kibotos-node.service",
                                     "$CHECK; sleep 1000")
    assert not answer["ok"]
    assert "is not the main process of its unit kibotos-node.service" in answer["error"]


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.systemd
def test_an_invocation_systemd_does_not_know_is_refused(user_systemd):
    env = {"INVOCATION_ID": secrets.token_hex(16), "DBUS_SYSTEM_BUS_ADDRESS": user_systemd.bus}
    with pytest.raises(FailedPrecondition, match="systemd knows no unit with INVOCATION_ID"):
        check_startup(environ=env)
