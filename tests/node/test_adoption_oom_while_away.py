"""Troubleshooting row "After a VMM exits unexpectedly …" (spec: node-and-vmm-processes):
"A VMM killed by host OOM is a different case: ctrl stops its Workspace on its own …
Only if the OOM happened while the node was stopped and systemd already removed that
VMM unit does the Workspace stay here."  So a VMM OOM-killed while the node was away
whose failed unit systemd still has (``Result=oom-kill``) is reported ``oom_killed``
at the next start (which makes ctrl stop the Workspace,
ctrl/test_ctrl_workspaces_nodes.py::test_oom_kill_stops_the_workspace_and_start_works);
one whose unit is gone is "no longer running".

``direct`` cannot see an OOM kill; a direct supervisor that reports its ended units
with systemd's ``oom-kill`` stands in for systemd (as in
test_instance_lifecycle.py::test_an_oom_killed_vmm_fails_with_oom_killed).
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from adoption_harness import alive, node_at, node_root, start_instance
from instance_harness import DEADLINE, Node

from kibotos.node.instances.contract import FAILED
from kibotos.node.records.instance_dirs import EXITED_REASON, OOM_REASON


@pytest.fixture
async def base() -> AsyncIterator[Path]:
    async with node_root("ko-") as path:
        yield path


def oom_reporting(node: Node) -> None:
    direct = node.manager.launcher.supervisor

    class OomReporting(type(direct)):  # type: ignore[misc]
        async def describe(self, name):
            info = await super().describe(name)
            if info is not None and not info.active:
                info = dataclasses.replace(info, result="oom-kill")
            return info

        async def list(self, prefix):
            return [dataclasses.replace(i, result="oom-kill") if not i.active else i
                    for i in await super().list(prefix)]

    node.manager.launcher.supervisor = OomReporting({"state_dir": str(direct.state_dir)})


async def kill_vmm_while_away(base: Path) -> None:
    async with node_at(base) as node:
        await start_instance(node, "inst-1")
        pid = node.manager.get("inst-1").main_process[0]
    os.kill(pid, signal.SIGKILL)  # the host's OOM killer, while no node runs
    with trio.fail_after(DEADLINE):
        while alive(pid):
            await trio.sleep(0.05)


@pytest.mark.parametrize(("adjust", "reason"), [(oom_reporting, OOM_REASON),
                                                (None, EXITED_REASON)])
async def test_a_vmm_that_ended_while_the_node_was_away(base: Path, adjust, reason) -> None:
    await kill_vmm_while_away(base)
    async with node_at(base, adjust=adjust) as node:
        frame = await node.wait_state("inst-1", FAILED)
        assert frame["reason"] == reason
        assert node.manager.get("inst-1").state == FAILED
