"""The node's Instance manager with ``[supervisor] backend = "systemd"`` on a real systemd
(a user manager, usersystemd.py), with the light test VMM (tests/testplugins): the
spec's "Launch records and adoption" where units are host-wide.

* a launch runs the VMM as a transient unit in ``kibotos-vmm.slice`` and the launch
  record holds what systemd says of it (InvocationID, MainPID, cgroup);
* a new manager over the same storage root (a restarted node) adopts the unit: same
  process, same guest boot ID, RUNNING without a new launch;
* a ``kibotos-vmm-*`` unit whose command line does not name this node's Instance
  directory belongs to another node on the host: it neither refuses the start nor is
  touched; one that names it but has no record refuses the start;
* destroy stops the unit and leaves no process in its cgroup.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from systemd_helpers import Raw, new_supervisor
from usersystemd import UserSystemd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
from instance_harness import (
    FAST,
    Node,
    node_config,
    registries,
    short_dir,
    write_template,
)

from kibotos.backends import UnitSpec
from kibotos.core import atomicfile
from kibotos.node.instances.adoption import AdoptionRefused
from kibotos.node.instances.contract import RUNNING
from kibotos.node.instances.setup import build_instance_manager

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.systemd]

UNIT = "kibotos-vmm-inst-1.service"


@pytest.fixture
def base() -> Iterator[Path]:
    path = short_dir("ks-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def build(base: Path, bus: str) -> Node:
    config = node_config(base, extra=f'[supervisor]\nbackend = "systemd"\n'
                                     f'[supervisor.systemd]\nbus = "{bus}"\n')
    for sub in ("runtime", "template-cache", "machine-logs"):
        (config.storage.root / sub).mkdir(parents=True, exist_ok=True)
    template = write_template(base)
    manager = build_instance_manager(config, memory_tight=lambda: False,
                                     registries=registries(), settings=FAST,
                                     receipt_wait=1.0)
    manager.takeover.attempt_timeout = 1.0
    manager.takeover.backoff = (0.1, 0.5)
    return Node(base, config, manager, template)


@asynccontextmanager
async def node_at(base: Path, bus: str) -> AsyncIterator[Node]:
    """A running node over `base`; its units keep running when it ends."""
    node = build(base, bus)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.manager.run)
        yield node
        nursery.cancel_scope.cancel()


def launch_record(node: Node) -> dict:
    return atomicfile.read_json(node.root / "runtime" / "instances" / "inst-1" /
                                "systemd.json")


async def test_launch_adopt_and_destroy_through_systemd(user_systemd: UserSystemd,
                                                        raw: Raw, base: Path) -> None:
    bus = user_systemd.bus
    sup = new_supervisor(user_systemd)
    try:
        async with node_at(base, bus) as node:
            args = node.create_args("inst-1", workspace_id="ws-1")
            assert await node.command("instance.create", args) == {"accepted": True}
            await node.wait_state("inst-1", RUNNING)
            inst = node.manager.get("inst-1")
            main_pid = inst.main_process[0]
            boot_id = inst.guest["boot_id"]
        service = raw.props(UNIT)
        assert service["MainPID"] == main_pid  # the unit outlived the node
        assert service["ControlGroup"].endswith(f"/kibotos.slice/kibotos-vmm.slice/{UNIT}")
        unit = launch_record(node)["unit"]
        assert unit["main_pid"] == main_pid
        assert unit["cgroup"] == service["ControlGroup"]
        invocation = bytes(raw.props(UNIT, "Unit")["InvocationID"]).hex()
        assert unit["invocation_id"].replace("-", "") == invocation

        # Another node's VMM on this host: its command line does not name our directory.
        await sup.start(UnitSpec(name="kibotos-vmm-elsewhere.service",
                                 argv=["sleep", "1000"],
                                 properties={"Slice": "kibotos-vmm.slice"}))
        async with node_at(base, bus) as node:
            frame = await node.wait_state("inst-1", RUNNING)
            assert frame["state"] == RUNNING
            inst = node.manager.get("inst-1")
            assert inst.main_process[0] == main_pid  # adopted, not launched again
            with trio.fail_after(60):
                while (node.manager.get("inst-1").guest or {}).get("responding") is not True:
                    await trio.sleep(0.05)
            assert node.manager.get("inst-1").guest["boot_id"] == boot_id
            assert raw.props(UNIT)["MainPID"] == main_pid
            other = await sup.describe("kibotos-vmm-elsewhere.service")
            assert other is not None
            assert other.active  # untouched

            assert await node.command("instance.destroy", {"instance_id": "inst-1"}) == \
                {"destroyed": True}
            assert await sup.describe(UNIT) is None
            assert not (node.root / "runtime" / "instances" / "inst-1").exists()

        # A unit that names this node's Instance directory but has no record refuses.
        stray = node.root / "runtime" / "instances" / "inst-9"
        await sup.start(UnitSpec(name="kibotos-vmm-inst-9.service",
                                 argv=["sh", "-c", f": {stray}/agent.sock; exec sleep 1000"],
                                 properties={"Slice": "kibotos-vmm.slice"}))
        with pytest.raises(BaseExceptionGroup) as info:
            async with node_at(base, bus):
                pass
        found: BaseException = info.value
        while isinstance(found, BaseExceptionGroup):
            found = found.exceptions[0]
        assert isinstance(found, AdoptionRefused), found
        assert "kibotos-vmm-inst-9.service" in str(found)
    finally:
        for info in await sup.list("kibotos-vmm-"):
            await sup.stop(info.name, timeout=5)


async def test_check_maintenance_with_systemd_sees_only_this_nodes_units(
        user_systemd: UserSystemd, base: Path) -> None:
    """check-maintenance reads the same host-wide units: another node's VMM on this host
    is not a leftover of this node; an unrecorded unit naming this node's Instance
    directory is."""
    from kibotos.node.checks import maintenance_check

    bus = user_systemd.bus
    sup = new_supervisor(user_systemd)
    try:
        async with node_at(base, bus) as node:
            args = node.create_args("inst-1", workspace_id="ws-1")
            assert await node.command("instance.create", args) == {"accepted": True}
            await node.wait_state("inst-1", RUNNING)
        await sup.start(UnitSpec(name="kibotos-vmm-elsewhere.service",
                                 argv=["sleep", "1000"],
                                 properties={"Slice": "kibotos-vmm.slice"}))
        report = await maintenance_check.run(node.config, "upgrade", registries=registries())
        assert report.exit_code == 0, report.render()
        assert any(f"service {UNIT} matches its launch record" in line
                   for line in report.of("ok"))
        stray = node.root / "runtime" / "instances" / "inst-9"
        await sup.start(UnitSpec(name="kibotos-vmm-inst-9.service",
                                 argv=["sh", "-c", f": {stray}/agent.sock; exec sleep 1000"],
                                 properties={"Slice": "kibotos-vmm.slice"}))
        report = await maintenance_check.run(node.config, "upgrade", registries=registries())
        assert report.exit_code != 0
        blocked = report.of("blocked")
        assert any("kibotos-vmm-inst-9.service" in line for line in blocked), blocked
        assert not any("elsewhere" in line for line in blocked), blocked
    finally:
        for info in await sup.list("kibotos-vmm-"):
            await sup.stop(info.name, timeout=5)
