"""``kibotos-node check-upgrade [--preview]`` (spec: node-and-vmm-processes, "Checking
with the target binary before replacement", "Previewing with --preview"): each of its
four rules, its notes and its three kinds of lines, with real VMM units (``testvmm``)
left running by a stopped node; the target build is a `BuildIdentity`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from instance_harness import Node, registries
from upgrade_harness import left_node, snapshot

from kibotos.cli.roles.node_role_cmds import node_role_group
from kibotos.core import atomicfile
from kibotos.node.checks import upgrade_check
from kibotos.node.checks.check_report import Report
from kibotos.node.runtime import installations
from kibotos.node.runtime.build_identity import BuildIdentity

N = BuildIdentity(release="0.4.0")
N1 = BuildIdentity(release="0.4.1")
RUNTIME = installations.default_runtime_dir()


@pytest.fixture
async def stopped() -> AsyncIterator[Node]:
    """A node as release N that started inst-1 (ws-1) and stopped; its VMM runs on."""
    async with left_node(N) as node:
        yield node


async def check(node: Node, build: BuildIdentity = N1, *, preview: bool = False,
                runtime_dir: Path = RUNTIME) -> Report:
    return await upgrade_check.run(node.config, runtime_dir, preview=preview, build=build,
                                   registries=registries())


def launch_record(node: Node, iid: str = "inst-1") -> dict:
    return json.loads((node.root / "runtime" / "instances" / iid / "systemd.json").read_text())


def has(lines: list[str], *needles: str) -> bool:
    return any(all(n in line for n in needles) for line in lines)


def set_state(node: Node, state: str) -> None:
    path = node.root / "runtime" / "instances" / "inst-1" / "instance.json"
    data = json.loads(path.read_text())
    data["state"] = state
    atomicfile.write_json(path, data)


# ------------------------------------------------------------------ the four rules


async def test_after_shutdown_an_adoptable_node_passes(stopped: Node) -> None:
    report = await check(stopped, N)
    assert report.exit_code == 0, report.render()
    ok = report.of("ok")
    assert has(ok, "instance inst-1 (RUNNING): service kibotos-vmm-inst-1.service matches")
    assert has(ok, "launch, Instance and ended-Instance records: formats this version reads")
    assert has(ok, f"target runtime directory {RUNTIME} has the")
    ident = launch_record(stopped)["installation"]["identity"]
    assert has(ok, f"instance inst-1: runtime installation {ident} is the one this version "
                   "uses")
    assert has(ok, "instance inst-1: guest protocol version 1 (accepted 1)")
    assert not report.of("pending")


async def test_an_earlier_installation_in_range_is_reported_not_blocking(stopped: Node
                                                                        ) -> None:
    report = await check(stopped, N1)
    assert report.exit_code == 0, report.render()
    old = launch_record(stopped)["installation"]["identity"]
    target, _ = installations.planned(RUNTIME, N1)
    assert has(report.of("ok"), f"instance inst-1: uses earlier runtime installation {old} "
                                f"(runtime version 0.4.0); it keeps it, and switches to "
                                f"{target} on its next start")


@pytest.mark.parametrize("preview", [False, True])
async def test_a_runtime_outside_the_range_blocks(stopped: Node, preview: bool) -> None:
    report = await check(stopped, BuildIdentity(release="0.6.0"), preview=preview)
    assert report.exit_code == 13
    assert has(report.of("blocked"), "instance inst-1: runtime installation",
               "cannot be kept: runtime version 0.4.0 is outside the range node release "
               "0.6.0 can drive", "stop its Workspace normally first")


@pytest.mark.parametrize("damage", ["corrupted", "missing"])
async def test_a_corrupted_or_missing_installation_blocks(stopped: Node, damage: str) -> None:
    ident = launch_record(stopped)["installation"]["identity"]
    path = stopped.root / "installations" / ident
    if damage == "corrupted":
        (path / "kibotos" / "guest" / "agent.py").write_text("# changed\n")
    else:
        shutil.rmtree(path)
    report = await check(stopped, N1)
    assert has(report.of("blocked"), f"instance inst-1: runtime installation {ident} cannot "
                                     f"be kept: runtime installation {ident}", damage)
    assert report.exit_code == 13


@pytest.mark.parametrize("preview", [False, True])
async def test_a_guest_protocol_outside_the_range_blocks(stopped: Node, preview: bool) -> None:
    build = BuildIdentity(release="0.4.1", guest_protocols=(2, 3))
    report = await check(stopped, build, preview=preview)
    assert report.exit_code == 13
    assert has(report.of("blocked"), "instance inst-1: guest protocol version 1 is outside "
                                     "the range this version accepts (2 to 3)")


async def test_missing_guest_capabilities_are_listed_not_blocking(stopped: Node) -> None:
    build = BuildIdentity(release="0.4.1",
                          guest_capabilities=N1.guest_capabilities | {"zz.future"})
    report = await check(stopped, build)
    assert report.exit_code == 0, report.render()
    assert has(report.of("ok"), "instance inst-1: guest protocol version 1",
               "lacks capabilities zz.future: it is adopted, operations that use them fail "
               "until it restarts")


async def test_record_formats_outside_the_range_block(stopped: Node) -> None:
    build = BuildIdentity(release="0.4.1", record_formats=(2, 2))
    report = await check(stopped, build, preview=True)
    assert has(report.of("blocked"), "instances/inst-1/instance.json: format 1 is outside "
                                     "what this version reads (2)")
    assert has(report.of("blocked"), "systemd.json: format 1 is outside")
    assert report.exit_code == 13


async def test_identity_and_enrollment_formats(stopped: Node) -> None:
    identity = stopped.root / "pki" / "identity.json"
    identity.parent.mkdir(exist_ok=True)
    atomicfile.write_json(identity, {"identity_id": "kid-1", "enrolled_at": "x"})
    report = await check(stopped, preview=True)
    assert has(report.of("ok"), f"node identity {identity}: format 1")
    assert has(report.of("ok"), f"enrollment record {identity}: format 1")
    atomicfile.write_json(identity, {"identity_id": "kid-1", "format": 7})
    report = await check(stopped, preview=True)
    assert has(report.of("blocked"), f"node identity {identity}: format 7 is outside what "
                                     "this version reads (1)")
    assert has(report.of("blocked"), "enrollment record")
    identity.write_text("{broken")
    assert has((await check(stopped, preview=True)).of("blocked"), "node identity:",
               "unreadable")


async def test_a_target_runtime_directory_without_the_runtime_blocks(stopped: Node,
                                                                     tmp_path: Path) -> None:
    empty = tmp_path / "next"
    empty.mkdir()
    report = await check(stopped, runtime_dir=empty)
    assert has(report.of("blocked"), f"target runtime directory {empty} lacks "
                                     "kibotos/guest/agent.py")
    assert report.exit_code == 13
    report = await check(stopped, runtime_dir=tmp_path / "absent", preview=True)
    assert has(report.of("blocked"), f"target runtime directory {tmp_path / 'absent'} does "
                                     "not exist")


# ------------------------------------------------------------------ lock, preview, pending


def spawn_lock_holder(lock: Path) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys,time; from pathlib import Path; "
         "from kibotos.node.host.layout import OwnerLock; l=OwnerLock(Path(sys.argv[1])); "
         "l.acquire(); print('held', flush=True); time.sleep(600)", str(lock)],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "held"
    return holder


async def test_a_running_node_gets_only_runtime_in_use_and_preview_works(stopped: Node
                                                                        ) -> None:
    lock = stopped.root / "runtime" / "node.lock"
    holder = spawn_lock_holder(lock)
    try:
        report = await check(stopped)
        assert report.lines == [("blocked", (
            f"the runtime is already in use: a node process (pid {holder.pid}) holds the "
            f"owner lock {lock}; stop the node service first, or run check-upgrade with "
            "--preview"))]
        assert report.exit_code == 13
        preview = await check(stopped, preview=True)
        assert preview.exit_code == 0, preview.render()
        assert preview.lines[-1] == ("note", upgrade_check.PREVIEW_NOTE)
        assert has(preview.of("ok"), "guest protocol version 1")
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


@pytest.mark.parametrize(("state", "needle"), [("CREATING", "instance inst-1 is starting"),
                                               ("STOPPING", "instance inst-1 is stopping")])
async def test_preview_reports_starting_and_stopping_as_pending(stopped: Node, state: str,
                                                                needle: str) -> None:
    set_state(stopped, state)
    report = await check(stopped, preview=True)
    assert report.exit_code == 0, report.render()
    assert has(report.of("pending"), needle, "evaluated again after shutdown")
    full = await check(stopped)
    assert full.exit_code == 13  # the quiescence rules: half done
    assert not full.of("pending")


async def test_preview_reports_a_launch_record_being_written_as_pending(stopped: Node
                                                                       ) -> None:
    path = stopped.root / "runtime" / "instances" / "inst-1" / "systemd.json"
    data = json.loads(path.read_text())
    data["unit"] = None
    atomicfile.write_json(path, data)
    report = await check(stopped, preview=True)
    assert has(report.of("pending"), "instance inst-1: its launch record is being written")
    assert report.exit_code == 0


async def test_a_silent_guest_is_pending_in_preview_and_blocks_after_shutdown(
        stopped: Node) -> None:
    pid = launch_record(stopped)["unit"]["main_pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        report = await check(stopped, preview=True)
        assert report.exit_code == 0, report.render()
        assert has(report.of("pending"), "instance inst-1: the guest did not answer GuestInfo",
                   "evaluated again after shutdown")
        full = await check(stopped)
        assert full.exit_code == 13
        assert has(full.of("blocked"), "instance inst-1: the guest did not answer GuestInfo")
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_preview_does_not_evaluate_quiescence_or_ownership(stopped: Node) -> None:
    (stopped.root / "runtime" / "instances" / "inst-9").mkdir()
    preview = await check(stopped, preview=True)
    assert preview.exit_code == 0, preview.render()
    assert preview.lines[-1] == ("note", upgrade_check.PREVIEW_NOTE)
    full = await check(stopped)
    assert has(full.of("blocked"), "inst-9 has no Instance record: a leftover with no owner")


def _vmm_written(path: str) -> bool:
    """Files the running VMM itself writes (its logs, its guest's root)."""
    return path.endswith(("/vmm.log", "/console.log")) or "/guestroot" in path


@pytest.mark.parametrize("preview", [False, True])
async def test_the_check_writes_nothing(stopped: Node, preview: bool) -> None:
    roots = (stopped.root, stopped.pool)

    def state() -> dict:
        return {k: v for k, v in snapshot(*roots).items() if not _vmm_written(k)}

    before = state()
    report = await check(stopped, N1, preview=preview)
    assert report.exit_code == 0, report.render()
    assert state() == before
    assert not (stopped.root / "runtime" / "node.lock").exists()
    assert not list((stopped.root / "installations").glob(".tmp-*"))


def test_cli_lines_and_exit_codes(tmp_path: Path) -> None:
    runner = CliRunner()
    root = tmp_path / "root"
    config = tmp_path / "node.toml"
    config.write_text(f'[node]\nid = "node-a"\nctrl_url = "http://127.0.0.1:9"\n'
                      f'[storage]\nroot = "{root}"\n[resources]\ncpu = 1\nmemory = "1G"\n')
    ok = runner.invoke(node_role_group, ["check-upgrade", "--config", str(config),
                                         "--runtime-dir", str(RUNTIME), "--preview"])
    assert ok.exit_code == 0, ok.output
    lines = ok.output.splitlines()
    assert lines[-1] == "check-upgrade --preview: passed"
    assert lines[-2] == f"note: {upgrade_check.PREVIEW_NOTE}"
    assert all(line.startswith("ok: ") for line in lines[:-2])
    full = runner.invoke(node_role_group, ["check-upgrade", "--config", str(config),
                                           "--runtime-dir", str(tmp_path / "none")])
    assert full.exit_code == 13, full.output
    assert f"blocked: target runtime directory {tmp_path / 'none'} does not exist" in \
        full.output.splitlines()
    assert full.output.splitlines()[-1] == "check-upgrade: 1 blocking item(s)"
    missing = runner.invoke(node_role_group, ["check-upgrade", "--config",
                                              str(tmp_path / "nope.toml"), "--runtime-dir",
                                              str(RUNTIME)])
    assert missing.exit_code == 10


def test_upgrades_doc_names_every_option_line_kind_and_exit_code() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "upgrades.md").read_text()
    for name in ("check-maintenance", "check-upgrade"):
        cmd = node_role_group.get_command(None, name)  # type: ignore[arg-type]
        assert cmd is not None
        assert f"kibotos-node {name}" in doc
        for param in cmd.params:
            assert max(param.opts, key=len) in doc, (name, param.opts)
    for prefix in ("`ok:`", "`blocked:`", "`pending:`", "`note:`"):
        assert prefix in doc
    for code in ("| 0 |", "| 13 |", "| 10 |"):
        assert code in doc
    assert upgrade_check.GUEST_TIMEOUT == 10.0
    assert "within 10 s" in doc
