"""The upgrade path end to end on one storage root (issue 6, "Done when"): Workspaces'
Instances run on a build standing for release N (light ``testvmm`` VMMs under the
``direct`` supervisor); ``check-upgrade --preview`` as N+1 while the node runs; the node
stops; ``check-maintenance --operation upgrade`` as N and ``check-upgrade`` as N+1; the
node restarts as N+1 and adopts every Instance it can drive.  The blocking cases are
reported as ``blocked:`` first and then handled as the spec says (FAILED, VMM running):
a runtime outside N+1's range, a corrupted installation, a guest protocol outside the
range of the build after it.

Releases: inst-b was started by 0.3.9 (in N=0.4.2's range, outside N+1=0.5.0's),
inst-c by 0.4.0 (in both; its installation is then damaged), inst-a and inst-d by N.
The node here is the in-process Instance manager (no ctrl session): the release it
stands for is its `BuildIdentity`, which decides installations, ranges and checks."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import trio
from instance_harness import Node, registries, short_dir
from upgrade_harness import node_at, start, stop_units

from kibotos.node.checks import maintenance_check, upgrade_check
from kibotos.node.checks.check_report import Report
from kibotos.node.instances.contract import FAILED, RUNNING
from kibotos.node.runtime import installations
from kibotos.node.runtime.build_identity import BuildIdentity

pytestmark = pytest.mark.slow

OLDER = BuildIdentity(release="0.3.9")
EARLIER = BuildIdentity(release="0.4.0")
N = BuildIdentity(release="0.4.2")
N1 = BuildIdentity(release="0.5.0")
#: A later build that dropped guest protocol 1.
N2 = BuildIdentity(release="0.5.1", guest_protocols=(2, 2))
RUNTIME = installations.default_runtime_dir()


def unit_of(node: Node, iid: str) -> dict:
    path = node.root / "runtime" / "instances" / iid / "systemd.json"
    return json.loads(path.read_text())


async def upgrade_check_as(node: Node, build: BuildIdentity, *, preview: bool) -> Report:
    return await upgrade_check.run(node.config, RUNTIME, preview=preview, build=build,
                                   registries=registries())


def blocked_for(report: Report, iid: str) -> list[str]:
    return [line for line in report.of("blocked") if line.startswith(f"instance {iid}:")]


async def settled(node: Node) -> None:
    with trio.fail_after(120):
        await node.manager.takeover.wait_idle()


async def exec_echo(node: Node, iid: str) -> bytes:
    inst = node.manager.get(iid)
    assert inst is not None
    async with node.manager.launcher.guest(inst) as guest:
        status, out, _ = await guest.run(["sh", "-c", "echo adopted"])
    assert status.exit_code == 0
    return out


async def unit_active(node: Node, iid: str) -> bool:
    info = await node.manager.launcher.supervisor.describe(f"kibotos-vmm-{iid}.service")
    return info is not None and info.active


async def test_upgrade_from_n_to_n_plus_1(caplog: pytest.LogCaptureFixture) -> None:
    base = short_dir()
    try:
        async with node_at(base, OLDER) as node:
            await start(node, "inst-b", "ws-b")
        async with node_at(base, EARLIER) as node:
            await settled(node)
            assert node.manager.get("inst-b").state == RUNNING
            await start(node, "inst-c", "ws-c")
        async with node_at(base, N) as node:
            await settled(node)
            for iid in ("inst-b", "inst-c"):
                assert node.manager.get(iid).state == RUNNING, iid
            await start(node, "inst-a", "ws-a")
            await start(node, "inst-d", "ws-d")
            # before the window, on the live node: the preview of the target build
            preview = await upgrade_check_as(node, N1, preview=True)
            assert preview.lines[-1] == ("note", upgrade_check.PREVIEW_NOTE)
            assert [line.split(":")[0] for line in preview.of("blocked")] == \
                ["instance inst-b"]
            assert "runtime version 0.3.9 is outside the range node release 0.5.0" in \
                preview.of("blocked")[0]
            assert preview.exit_code == 13
        before = {iid: unit_of(node, iid)["unit"] for iid in
                  ("inst-a", "inst-b", "inst-c", "inst-d")}

        # the node is stopped: the checks of the window
        maintenance = await maintenance_check.run(node.config, "upgrade",
                                                  registries=registries())
        assert maintenance.exit_code == 0, maintenance.render()
        c_install = unit_of(node, "inst-c")["installation"]["identity"]
        damaged = node.root / "installations" / c_install / "kibotos" / "guest" / "agent.py"
        damaged.write_text("# damaged after the preview\n")
        full = await upgrade_check_as(node, N1, preview=False)
        assert full.exit_code == 13
        assert len(blocked_for(full, "inst-b")) == 1
        assert "outside the range" in blocked_for(full, "inst-b")[0]
        assert len(blocked_for(full, "inst-c")) == 1
        assert "is corrupted" in blocked_for(full, "inst-c")[0]
        assert not blocked_for(full, "inst-a")
        assert not blocked_for(full, "inst-d")
        assert len(full.of("blocked")) == 2, full.render()

        # replaced by N+1: a and d adopted as they run, b and c FAILED with VMMs running
        with caplog.at_level(logging.INFO):
            async with node_at(base, N1) as node:
                await settled(node)
                for iid in ("inst-a", "inst-d"):
                    assert node.manager.get(iid).state == RUNNING, iid
                    assert unit_of(node, iid)["unit"] == before[iid]
                    assert await exec_echo(node, iid) == b"adopted\n"
                for iid in ("inst-b", "inst-c"):
                    inst = node.manager.get(iid)
                    assert inst.state == FAILED, iid
                    assert inst.reason.startswith("recover instance process: ")
                    assert "compatible runtime installation unavailable" in inst.reason
                    assert await unit_active(node, iid)
                    assert unit_of(node, iid)["unit"] == before[iid]
                kept = {p.name for p in (node.root / "installations").iterdir()}
                for iid in ("inst-a", "inst-b", "inst-c"):
                    assert unit_of(node, iid)["installation"]["identity"] in kept
                # a new start uses N+1's installation
                await start(node, "inst-e", "ws-e")
                new = unit_of(node, "inst-e")["installation"]
                assert new["runtime_version"] == "0.5.0"
                assert new == node.manager.launcher.installation
        messages = [r.getMessage() for r in caplog.records]
        refused = [m for m in messages if m.startswith(installations.NOT_RETAINED_EVENT)]
        assert any("instance=inst-b" in m and "outside the range" in m for m in refused)
        assert any("instance=inst-c" in m and "corrupted" in m for m in refused)

        # a build that dropped the guests' protocol: blocked first, FAILED at its start
        guests = await upgrade_check_as(node, N2, preview=False)
        for iid in ("inst-a", "inst-d", "inst-e"):
            assert any("guest protocol version 1 is outside the range" in line
                       for line in blocked_for(guests, iid)), guests.render()
        async with node_at(base, N2) as node:
            await settled(node)
            for iid in ("inst-a", "inst-d", "inst-e"):
                inst = node.manager.get(iid)
                assert inst.state == FAILED, iid
                assert "guest refused" in inst.reason
                assert await unit_active(node, iid)
    finally:
        await stop_units(base)
        shutil.rmtree(base, ignore_errors=True)


def test_runtime_directories_are_what_the_checks_read() -> None:
    """The target runtime directory of these tests is this checkout's: it holds the
    runtime pieces (a packaged build ships the same layout)."""
    assert not installations.missing_files(RUNTIME, installations.required_files())
    assert (Path(RUNTIME) / "kibotos" / "guest" / "agent.py").is_file()
