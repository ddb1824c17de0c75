"""``kibotos-node check-maintenance`` (spec: node-and-vmm-processes, "Pre-replacement
check: check-maintenance"): one test per row of its table and per note, on a real
storage root with real VMM units (``testvmm`` under the ``direct`` supervisor) left
running by a stopped node."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from click.testing import CliRunner
from instance_harness import Node, registries, short_dir
from upgrade_harness import left_node, node_at, snapshot

from kibotos.backends import UnitSpec
from kibotos.cli.roles.node_role_cmds import node_role_group
from kibotos.config import NodeConfig, parse
from kibotos.core import atomicfile
from kibotos.node.checks import maintenance_check
from kibotos.node.checks.check_report import Report
from kibotos.node.instances.setup import supervisor_options
from kibotos.node.runtime.build_identity import BuildIdentity

N = BuildIdentity(release="0.4.0")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")


@pytest.fixture
async def stopped() -> AsyncIterator[Node]:
    """A node that started inst-1 (ws-1) and stopped: its VMM still runs."""
    async with left_node(N) as node:
        yield node


async def check(node: Node, operation: str = "upgrade") -> Report:
    return await maintenance_check.run(node.config, operation, registries=registries())


def inst_dir(node: Node, iid: str = "inst-1") -> Path:
    return node.root / "runtime" / "instances" / iid


def edit(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        target = data
        *parents, last = key.split("__")
        for p in parents:
            target = target[p]
        target[last] = value
    atomicfile.write_json(path, data)


def alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def run(argv: list[str], check: bool = True) -> None:
    subprocess.run(argv, check=check)


def spawn(argv: list[str], **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, text=True, **kw)


def only_blocked(report: Report, *needles: str) -> None:
    blocked = report.of("blocked")
    assert report.exit_code == 13, report.render()
    for needle in needles:
        assert any(needle in line for line in blocked), (needle, report.render())


# ------------------------------------------------------------------ table rows


async def test_upgrade_allows_running_instances_whose_records_match(stopped: Node) -> None:
    report = await check(stopped)
    assert report.exit_code == 0, report.render()
    assert any("instance inst-1 (RUNNING): service kibotos-vmm-inst-1.service matches" in line
               for line in report.of("ok"))


@pytest.mark.parametrize(("key", "value", "label"), [
    ("unit__invocation_id", "0" * 32, "InvocationID"),
    ("unit__main_pid", 1, "PID"),
    ("unit__start_time_ticks", 1, "start time"),
    ("unit__executable", "/bin/false", "executable path"),
    ("unit__executable_dev_ino", [1, 2], "executable dev:ino"),
    ("unit__cgroup", "/elsewhere", "cgroup"),
    ("unit__netns_inode", 1, "network namespace"),
])
async def test_upgrade_blocks_a_record_that_does_not_match_the_service(
        stopped: Node, key: str, value: object, label: str) -> None:
    edit(inst_dir(stopped) / "systemd.json", **{key: value})
    report = await check(stopped)
    only_blocked(report, f"instance inst-1: its launch record does not match service "
                         f"kibotos-vmm-inst-1.service: {label} differ")


@pytest.mark.parametrize(("state", "needle"), [
    ("CREATING", "its launch is half done (state CREATING)"),
    ("STOPPING", "its stop is half done (state STOPPING)"),
    ("STOPPED", "requires cleanup: it ended (state STOPPED)"),
])
async def test_upgrade_blocks_half_done_operations(stopped: Node, state: str,
                                                   needle: str) -> None:
    edit(inst_dir(stopped) / "instance.json", state=state)
    only_blocked(await check(stopped), needle)


async def test_upgrade_blocks_a_launch_record_without_service_facts(stopped: Node) -> None:
    edit(inst_dir(stopped) / "systemd.json", unit=None)
    only_blocked(await check(stopped), "launch record lacks the service facts")


async def test_upgrade_blocks_a_running_record_whose_service_is_gone(stopped: Node) -> None:
    pid = json.loads((inst_dir(stopped) / "systemd.json").read_text())["unit"]["main_pid"]
    os.kill(pid, signal.SIGKILL)
    with trio.fail_after(60):
        while alive(pid):
            await trio.sleep(0.05)
    only_blocked(await check(stopped), "its record says RUNNING but its service "
                                       "kibotos-vmm-inst-1.service is not running")


async def test_upgrade_lets_detached_objects_stay_and_remove_refuses_them() -> None:
    async with left_node(N, stop_instance=True) as node:
        report = await check(node, "upgrade")
        assert report.exit_code == 0, report.render()
        assert any("1 detached Volumes and retained layers stay held by this node" in line
                   for line in report.of("ok"))
        only_blocked(await check(node, "remove"),
                     "retained layer ws-1 in storage pool pool-a is held by this node")


async def test_remove_requires_no_instance(stopped: Node) -> None:
    only_blocked(await check(stopped, "remove"),
                 "instance inst-1 is active or requires cleanup (state RUNNING)")


async def test_remove_passes_on_an_empty_node() -> None:
    base = short_dir()
    try:
        async with node_at(base, N) as node:
            pass
        report = await check(node, "remove")
        assert report.exit_code == 0, report.render()
        assert "no Volume or retained layer is held by this node" in report.of("ok")
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def test_a_node_that_never_ran_passes_without_asking_its_supervisor(
        tmp_path: Path) -> None:
    """Installed, never started (the package's prerm in a chroot, piuparts): no storage
    root, so no service to look for; the systemd supervisor's bus is not even there,
    and the example pool that was never made blocks no removal."""
    text = f"""
[node]
id = "node-a"
ctrl_url = "http://127.0.0.1:9"
[storage]
root = "{tmp_path / 'root'}"
[[storage.pool]]
id = "pool-a"
path = "{tmp_path / 'pool-a'}"
default = true
[resources]
cpu = 1
memory = "1G"
[supervisor]
backend = "systemd"
[supervisor.systemd]
bus = "unix:path={tmp_path / 'no-bus'}"
"""
    config = parse(NodeConfig, tomllib.loads(text), "test node.toml")
    for operation in ("upgrade", "remove"):
        report = await maintenance_check.run(config, operation)
        assert report.exit_code == 0, report.render()
        assert any("no node ever ran on storage root" in line for line in report.of("ok"))
    assert not (tmp_path / "root").exists()
    # Once a node ran there (its storage root), the supervisor is asked: no bus.
    (tmp_path / "root").mkdir()
    with pytest.raises(Exception, match="no-bus"):
        await maintenance_check.run(config, "remove")


# ------------------------------------------------------------------ leftovers


@pytest.mark.parametrize("operation", ["upgrade", "remove"])
async def test_an_instance_directory_without_record_is_a_leftover(stopped: Node,
                                                                  operation: str) -> None:
    (stopped.root / "runtime" / "instances" / "inst-9").mkdir()
    only_blocked(await check(stopped, operation),
                 "instances/inst-9 has no Instance record: a leftover with no owner")


async def test_a_vmm_service_without_record_is_a_leftover(stopped: Node) -> None:
    sup = registries().supervisor.get("direct")(supervisor_options(stopped.config))
    await sup.start(UnitSpec(name="kibotos-vmm-inst-zz.service", argv=["/bin/sleep", "600"]))
    only_blocked(await check(stopped),
                 "service kibotos-vmm-inst-zz.service (running) has no Instance record")


async def test_a_network_record_without_instance_is_a_leftover(stopped: Node) -> None:
    from kibotos.network_config import NetworkSection
    from kibotos.node.network.policy import NetworkPolicy
    from kibotos.node.network.records import NetworkRecords

    records = NetworkRecords(stopped.root / "network")
    records.allocate("inst-1", "7e570000", NetworkSection(ipv4_pool="10.200.0.0/24"),
                     NetworkPolicy(public_egress=False), [])
    report = await check(stopped)
    assert report.exit_code == 0, report.render()
    (records.directory / "inst-7.json").write_text("{}")
    only_blocked(await check(stopped), "network record", "inst-7.json belongs to no Instance")
    (records.directory / "inst-7.json").unlink()
    (records.directory / "inst-1.json").write_text("{}")  # its Instance's, unreadable
    only_blocked(await check(stopped), "network record", "inst-1.json: corrupted record")


async def test_a_mount_without_instance_is_a_leftover(stopped: Node) -> None:
    owned = inst_dir(stopped) / "mnt"
    stray = stopped.root / "runtime" / "stray"
    owned.mkdir()
    stray.mkdir()
    run(["mount", "-t", "tmpfs", "tmpfs", str(owned)], check=True)
    try:
        report = await check(stopped)
        assert report.exit_code == 0, report.render()
        run(["mount", "-t", "tmpfs", "tmpfs", str(stray)], check=True)
        try:
            only_blocked(await check(stopped), f"mount {stray} (tmpfs) belongs to no Instance")
        finally:
            run(["umount", str(stray)], check=True)
    finally:
        run(["umount", str(owned)], check=True)


async def test_a_staging_entry_without_command_is_a_leftover(stopped: Node) -> None:
    staging = stopped.pool / "volumes" / "transfer-staging"
    staging.mkdir(parents=True, exist_ok=True)
    (staging / ".node-a.download-import-3170412187.tar").write_bytes(b"partial")
    report = await check(stopped)
    assert report.exit_code == 0, report.render()
    (staging / "export-1.tar").write_bytes(b"left")
    only_blocked(await check(stopped), f"staging entry {staging / 'export-1.tar'} belongs "
                                       "to no running command")


async def test_a_helper_process_still_running_blocks(stopped: Node) -> None:
    helper = spawn(["/bin/sleep", "600"], cwd=stopped.root / "runtime")
    try:
        only_blocked(await check(stopped), f"helper process {helper.pid} (/bin/sleep 600) "
                                           "is still running")
    finally:
        helper.kill()
        helper.wait()
    assert (await check(stopped)).exit_code == 0


async def test_dataplane_processes_are_neither_checked_nor_ended(stopped: Node) -> None:
    sup = registries().supervisor.get("direct")(supervisor_options(stopped.config))
    info = await sup.start(UnitSpec(name="kibotos-dataplane-abcd1234-1.service",
                                    argv=["/bin/sleep", "600"],
                                    working_directory=stopped.root / "runtime"))
    report = await check(stopped, "upgrade")
    assert report.exit_code == 0, report.render()
    described = await sup.describe(info.name)
    assert described is not None
    assert described.active


# ------------------------------------------------------------------ notes


async def test_temporary_files_of_interrupted_writes_do_not_count(stopped: Node) -> None:
    (stopped.root / "runtime" / "registry").mkdir(exist_ok=True)
    (stopped.root / "runtime" / "registry" / ".record-2826134621.tmp").write_text("{")
    (stopped.root / "network").mkdir(exist_ok=True)
    (stopped.root / "network" / ".inst-5-123.tmp").write_text("{")
    (stopped.root / "runtime" / "instances" / ".instance-1.tmp").write_text("{")
    (inst_dir(stopped) / ".systemd-99.tmp").write_text("{")
    report = await check(stopped)
    assert report.exit_code == 0, report.render()


@pytest.mark.parametrize("name", ["instance.json", "systemd.json"])
async def test_a_corrupted_record_blocks(stopped: Node, name: str) -> None:
    (inst_dir(stopped) / name).write_text("{not json")
    only_blocked(await check(stopped), "instance inst-1: corrupted record")


async def test_a_corrupted_ended_instance_record_blocks(stopped: Node) -> None:
    registry = stopped.root / "runtime" / "registry"
    registry.mkdir(exist_ok=True)
    (registry / "inst-0.json").write_text("[]")
    only_blocked(await check(stopped), "ended-instance record inst-0.json: corrupted record")


async def test_the_running_node_holds_the_owner_lock(stopped: Node) -> None:
    lock = stopped.root / "runtime" / "node.lock"
    holder = spawn(
        [sys.executable, "-c", "import sys,time; from pathlib import Path; "
         "from kibotos.node.host.layout import OwnerLock; l=OwnerLock(Path(sys.argv[1])); "
         "l.acquire(); print('held', flush=True); time.sleep(600)", str(lock)],
        stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        report = await check(stopped)
        assert report.of("blocked") == [
            f"the runtime is already in use: a node process (pid {holder.pid}) holds the "
            f"owner lock {lock}; stop the node service first"]
        assert report.exit_code == 13
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    assert (await check(stopped)).exit_code == 0


async def test_objects_held_by_another_node_do_not_block_remove() -> None:
    base = short_dir()
    try:
        async with node_at(base, N) as node:
            pass
        holders = node.pool / "volumes" / "holders"
        holders.mkdir(parents=True, exist_ok=True)
        atomicfile.write_json(holders / "vol-1.json", {"node_id": "node-b", "epoch": 3})
        report = await check(node, "remove")
        assert report.exit_code == 0, report.render()
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def test_the_check_writes_nothing(stopped: Node) -> None:
    roots = (stopped.root, stopped.pool)
    before = snapshot(*roots)
    assert not (stopped.root / "runtime" / "node.lock").exists()
    for operation in ("upgrade", "remove"):
        await check(stopped, operation)
    assert snapshot(*roots) == before
    assert not (stopped.root / "runtime" / "node.lock").exists()


def test_cli_lines_and_exit_codes(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(node_role_group, ["check-maintenance", "--config",
                                              str(tmp_path / "nope.toml"), "--operation",
                                              "upgrade"])
    assert missing.exit_code == 10, missing.output
    root = tmp_path / "root"
    config = tmp_path / "node.toml"
    config.write_text(f'[node]\nid = "node-a"\nctrl_url = "http://127.0.0.1:9"\n'
                      f'[storage]\nroot = "{root}"\n'
                      '[resources]\ncpu = 1\nmemory = "1G"\n')
    ok = runner.invoke(node_role_group, ["check-maintenance", "--config", str(config),
                                         "--operation", "remove"])
    assert ok.exit_code == 0, ok.output
    assert ok.output.splitlines()[-1] == "check-maintenance --operation remove: passed"
    assert all(line.startswith("ok: ") for line in ok.output.splitlines()[:-1])
    assert not root.exists()  # no directory created
    (root / "runtime" / "instances" / "inst-3").mkdir(parents=True)
    blocked = runner.invoke(node_role_group, ["check-maintenance", "--config", str(config),
                                              "--operation", "upgrade"])
    assert blocked.exit_code == 13, blocked.output
    assert any(line.startswith("blocked: instance directory ")
               for line in blocked.output.splitlines())
    assert blocked.output.splitlines()[-1] == \
        "check-maintenance --operation upgrade: 1 blocking item(s)"


def firecracker_config(node: Node, sandbox: Path) -> NodeConfig:
    """The node's configuration with the firecracker backend and its sandbox root."""
    pool = node.config.storage.pool[0]
    text = f"""
[node]
id = "{node.config.node.id}"
ctrl_url = "http://127.0.0.1:9"
[storage]
root = "{node.root}"
[[storage.pool]]
id = "{pool.id}"
path = "{pool.path}"
default = true
[resources]
cpu = 4
memory = "8G"
[vmm]
backend = "firecracker"
[vmm.firecracker]
chroot_base_dir = "{sandbox}"
"""
    return parse(NodeConfig, tomllib.loads(text), "test node.toml")


async def test_the_firecracker_sandbox_root_may_stay_only_as_a_root_tmpfs_of_instances(
        stopped: Node) -> None:
    sandbox = stopped.base / "jailer"
    sandbox.mkdir()
    config = firecracker_config(stopped, sandbox)

    async def verdict() -> Report:
        return await maintenance_check.run(config, "upgrade", registries=registries())

    (sandbox / "firecracker" / "inst-1").mkdir(parents=True)
    only_blocked(await verdict(), f"sandbox root {sandbox}: it is not a tmpfs")
    shutil.rmtree(sandbox / "firecracker")
    run(["mount", "-t", "tmpfs", "-o", "mode=0700", "tmpfs", str(sandbox)])
    try:
        (sandbox / "firecracker" / "inst-1" / "root").mkdir(parents=True)
        report = await verdict()
        assert report.exit_code == 0, report.render()
        (sandbox / "firecracker" / "inst-7").mkdir()
        only_blocked(await verdict(), f"sandbox root {sandbox}: {sandbox}/firecracker/inst-7 "
                                      "belongs to no Instance")
        (sandbox / "firecracker" / "inst-7").rmdir()
        sandbox.chmod(0o755)
        only_blocked(await verdict(), "it is not a directory owned by root with mode 0700")
    finally:
        run(["umount", str(sandbox)])
