"""The kill matrix: a real node process (the Instance manager with the ``direct``
supervisor and the light test VMM) is SIGKILLed at every step of create, stop and
delete (the ``node.instance.*`` failpoints of `kibotos.core.failpoints.KNOWN`), a new node
process starts over the same storage root, ctrl's command is repeated as ctrl repeats
it (same arguments, through the node's session command handlers), and every case must
converge: the state ctrl expects (a create ends RUNNING, a stop STOPPED, a delete
destroyed), one VMM at most and never a second one for the same Instance, and after the
end no VMM process or unit, no Instance directory, no temporary file, the objects
released.  A start in kibotos is the create of a new Instance, so the create rows are
the start rows too."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from adoption_harness import alive, node_at, node_root, run_child
from instance_harness import Node

from kibotos.core import atomicfile, failpoints
from kibotos.node.instances.contract import RUNNING

pytestmark = pytest.mark.slow

CREATE_STEPS = ["node.instance.after-objects-open", "node.instance.after-launch-record",
                "node.instance.after-unit-start", "node.instance.after-ready"]
STOP_STEPS = ["node.instance.before-stop", "node.instance.after-stop",
              "node.instance.before-object-release", "node.instance.after-object-release"]
ID = "inst-1"


@pytest.fixture
async def base() -> AsyncIterator[Path]:
    async with node_root("km-") as path:
        yield path


def create_args(base: Path) -> dict[str, Any]:
    from instance_harness import write_template

    return {"instance_id": ID, "workspace_id": "ws-1", "template": write_template(base),
            "cpu_millis": 1000, "memory_bytes": 256 << 20,
            "layer": {"pool_id": "pool-a", "ref": "ws-1", "capacity_bytes": 64 << 20,
                      "epoch": 1, "create": True},
            "volumes": [], "launch": {"hostname": "box-1", "env": {}}}


def unit_records(base: Path) -> list[dict[str, Any]]:
    sup = base / "root" / "runtime" / "supervisor"
    return [atomicfile.read_json(p) for p in sorted(sup.glob("kibotos-vmm-*.json"))]


def temp_files(base: Path) -> list[Path]:
    return list(base.rglob(".*.tmp"))


async def assert_clean(node: Node, base: Path, pids: list[int], final: str) -> None:
    """Nothing of the Instance is left running or lying around; its end recorded."""
    assert await node.manager.launcher.supervisor.list("kibotos-vmm-") == []
    assert unit_records(base) == []
    assert [p for p in pids if alive(p)] == []
    assert list((node.root / "runtime" / "instances").iterdir()) == []
    assert node.manager.get(ID) is None
    assert node.manager.holdings().instance_count == 0
    assert temp_files(base) == []
    entry = node.manager.dirs.ended(ID)
    assert entry is not None
    assert entry["state"] == final
    meta = atomicfile.read_json(node.pool / "retained-layers" / "metadata" / "ws-1.json")
    assert meta["state"] == "released", meta


def test_the_matrix_names_known_failpoints() -> None:
    assert set(CREATE_STEPS + STOP_STEPS) <= set(failpoints.KNOWN)


@pytest.mark.parametrize("step", CREATE_STEPS)
async def test_killed_during_create(base: Path, step: str) -> None:
    args = create_args(base)
    await run_child(base, [("instance.create", args)], step)
    left = [r["main_pid"] for r in unit_records(base)]
    async with node_at(base) as node:
        # ctrl repeats its create: the same Instance, not a second one
        assert await node.command("instance.create", args) == {"accepted": True}
        await node.wait_state(ID, RUNNING)
        units = await node.manager.launcher.supervisor.list("kibotos-vmm-")
        assert [u.active for u in units] == [True]
        if left:  # a VMM ran at the kill: it was adopted, not started again
            assert [u.main_pid for u in units] == left
        pids = [units[0].main_pid]
        assert node.manager.holdings().instance_count == 1
        await node.manager.takeover.wait_idle()
        assert await node.command("instance.destroy", {"instance_id": ID}) == \
            {"destroyed": True}
        await assert_clean(node, base, pids + left, "DESTROYED")


@pytest.mark.parametrize("step", STOP_STEPS)
async def test_killed_during_stop(base: Path, step: str) -> None:
    stop = {"instance_id": ID, "force": False, "deadline_s": 10}
    await run_child(base, [("instance.create", create_args(base)), ("wait", ID),
                           ("instance.stop", stop)], step)
    pids = [r["main_pid"] for r in unit_records(base)]
    async with node_at(base) as node:
        assert node.manager.get(ID) is not None  # still there: the stop did not finish
        result = await node.command("instance.stop", stop)  # ctrl repeats the stop
        assert set(result) == {"confirmed_on_disk"}
        await assert_clean(node, base, pids, "STOPPED")
        # a further repeat answers from the registry entry
        assert await node.command("instance.stop", stop) == result


@pytest.mark.parametrize("step", STOP_STEPS)
async def test_killed_during_delete(base: Path, step: str) -> None:
    await run_child(base, [("instance.create", create_args(base)), ("wait", ID),
                           ("instance.destroy", {"instance_id": ID})], step)
    pids = [r["main_pid"] for r in unit_records(base)]
    async with node_at(base) as node:
        assert await node.command("instance.destroy", {"instance_id": ID}) == \
            {"destroyed": True}
        await assert_clean(node, base, pids, "DESTROYED")
