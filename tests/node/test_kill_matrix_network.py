"""The kill matrix's network rows (test_kill_matrix.py has the rest): a node process
with ``[network]`` (in a world of test namespaces, node_network_harness) is SIGKILLed
at every step of an Instance's network setup and teardown (the ``node.network.*`` and
network ``node.instance.*`` failpoints of `kibotos.core.failpoints.KNOWN`), and at the
launch steps after it; a new node process starts over the same storage root, ctrl's
command is repeated, and every case must converge: a create ends RUNNING with a guest
that reaches the test internet, a delete or stop ends with no network namespace, veth,
tap, address, table or network record left."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from adoption_harness import build_node, node_at, run_child
from node_network_harness import Bed, guest, leftovers, network_bed
from test_kill_matrix import assert_clean, unit_records

from kibotos.core import failpoints
from kibotos.node.instances.contract import RUNNING

pytestmark = [pytest.mark.slow, pytest.mark.root]

ID = "inst-1"
CREATE_STEPS = ["node.network.after-netns", "node.network.after-veth",
                "node.network.after-tap", "node.network.after-addresses",
                "node.network.after-table", "node.instance.after-network",
                "node.instance.after-unit-start", "node.instance.after-ready"]
TEARDOWN_STEPS = ["node.instance.before-network-teardown",
                  "node.network.teardown.after-devices"]


@pytest.fixture
async def bed() -> AsyncIterator[Bed]:
    async with network_bed("kmn-") as value:
        yield value


def create_args(bed: Bed) -> dict:
    node = build_node(bed.base, **bed.parts)  # for its create arguments only
    return node.create_args(ID, workspace_id="ws-1", network={}, network_revision=1)


def test_the_matrix_names_known_failpoints() -> None:
    assert set(CREATE_STEPS + TEARDOWN_STEPS) <= set(failpoints.KNOWN)


@pytest.mark.parametrize("step", CREATE_STEPS)
async def test_killed_during_create(bed: Bed, step: str) -> None:
    args = create_args(bed)
    await run_child(bed.base, [("instance.create", args)], step, **bed.parts)
    left = [r["main_pid"] for r in unit_records(bed.base)]
    async with node_at(bed.base, **bed.parts) as node:
        assert await node.command("instance.create", args) == {"accepted": True}
        await node.wait_state(ID, RUNNING)
        await node.manager.takeover.wait_idle()
        units = await node.manager.launcher.supervisor.list("kibotos-vmm-")
        assert [u.active for u in units] == [True]
        if left:  # a VMM ran at the kill: it was adopted, not started again
            assert [u.main_pid for u in units] == left
        assert await guest(node, ID, "fetch", "198.18.0.1") == "198.18.0.1"
        pids = [units[0].main_pid]
        assert await node.command("instance.destroy", {"instance_id": ID}) == \
            {"destroyed": True}
        await assert_clean(node, bed.base, pids + left, "DESTROYED")
    assert leftovers(bed.base, bed.world) == []


@pytest.mark.parametrize("final", ["instance.destroy", "instance.stop"])
@pytest.mark.parametrize("step", TEARDOWN_STEPS)
async def test_killed_during_teardown(bed: Bed, step: str, final: str) -> None:
    ended = {"instance.destroy": {"instance_id": ID},
             "instance.stop": {"instance_id": ID, "force": False, "deadline_s": 10}}[final]
    await run_child(bed.base, [("instance.create", create_args(bed)), ("wait", ID),
                               (final, ended)], step, **bed.parts)
    pids = [r["main_pid"] for r in unit_records(bed.base)]
    async with node_at(bed.base, **bed.parts) as node:
        await node.command(final, ended)  # ctrl repeats it
        await assert_clean(node, bed.base, pids,
                           "DESTROYED" if final == "instance.destroy" else "STOPPED")
    assert leftovers(bed.base, bed.world) == []
