"""The Troubleshooting row "Reclaiming such an Instance fails with an error that contains
stop instance process this node did not take over" (spec: node-and-vmm-processes), its
resolution on the node: the records are kept, the operator stops only the unit named in
the error (what ``systemctl stop <unit>`` does), and the same command then succeeds,
because a unit that no longer runs needs no proof of ownership.

The refusal itself (records that disagree, the unit left running) is
tests/node/test_adoption.py::test_a_refusing_guest_fails_and_reclaim_checks_ownership;
the retry with the same command ID through ctrl is
tests/ctrl/test_ctrl_stop_prepare_failed.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from adoption_harness import alive, node_at, node_root, start_instance
from instance_harness import Node

from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition
from kibotos.node.instances.adoption import NOT_TAKEN_OVER
from kibotos.node.instances.contract import FAILED


@pytest.fixture
async def base() -> AsyncIterator[Path]:
    async with node_root("kr-") as path:
        yield path


def narrow(node: Node) -> None:
    """A build whose guest protocol range excludes the guest: its takeover fails."""
    launcher = node.manager.launcher
    launcher.build = dataclasses.replace(launcher.build, guest_protocols=(99, 99))


@pytest.mark.parametrize("command", ["instance.stop", "instance.destroy"])
async def test_after_the_operator_stops_the_unit_the_same_command_succeeds(
        base: Path, command: str) -> None:
    async with node_at(base) as node:
        await start_instance(node, "inst-1")
        main = node.manager.get("inst-1").main_process
    async with node_at(base, adjust=narrow) as node:
        await node.wait_state("inst-1", FAILED)
    inst_dir = base / "root" / "runtime" / "instances" / "inst-1"
    record = atomicfile.read_json(inst_dir / "instance.json")
    record["main_process"] = [main[0] + 1, 1]  # the records disagree with the unit
    atomicfile.write_json(inst_dir / "instance.json", record, mode=0o600)
    args = {"instance_id": "inst-1", "force": True} if command == "instance.stop" \
        else {"instance_id": "inst-1"}
    async with node_at(base) as node:
        with pytest.raises(FailedPrecondition, match=NOT_TAKEN_OVER) as info:
            await node.command(command, args)
        unit = info.value.details["unit"]
        assert alive(main[0])
        # The operator confirmed the unit is this Instance's VMM and stopped only it.
        supervisor = node.manager.launcher.supervisor
        await supervisor.stop(unit, timeout=10)
        assert not alive(main[0])
        # The same command again: no running unit, nothing to prove; resources released.
        result = await node.command(command, args)
        if command == "instance.stop":  # a FAILED Instance's stop --force destroys it
            assert result == {"confirmed_on_disk": False}
        else:
            assert result["destroyed"] is True
        assert node.manager.get("inst-1") is None
        assert await supervisor.list("kibotos-vmm-") == []
        assert not inst_dir.exists()
