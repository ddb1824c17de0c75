"""The Troubleshooting row "A Workspace fails to stop and stays FAILED with an error that
starts with prepare guest stop:" (spec: node-and-vmm-processes), through ctrl with a
simulated node whose ``instance.stop`` answers as the real node does when the guest
did not end its processes in time or could not sync/freeze
(`kibotos.node.instances.lifecycle`: ``failed_precondition``, ``prepare guest stop: …``).

The node side (the VMM keeps running, the layer is not released) is
tests/node/test_instance_lifecycle.py::test_failed_stop_prepare_leaves_the_vmm_running.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ctrl_helpers import wait_until
from ws_helpers import open_ws_ctrl

from kibotos.core.errors import FailedPrecondition
from kibotos.testing.clock import ThreadAwareClock

REASONS = ["prepare guest stop: deadline_exceeded: managed processes still running",
           "prepare guest stop: retained filesystem sync failed: /dev/vdb: EIO",
           "prepare guest stop: retained filesystem freeze failed: /data: EBUSY"]


@pytest.mark.parametrize("reason", REASONS)
async def test_a_failed_stop_prepare_is_failed_until_stop_force(tmp_path: Path,
                                                                reason: str,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        ws = await ctrl.settled((await ctrl.create(cpu_millis=1500))["workspace_id"])
        wid, sim = ws["workspace_id"], ctrl.sims["node-a"]
        sim.refuse_stop = FailedPrecondition(reason)
        await ctrl.action(wid, "stop")
        ws = await ctrl.settled(wid)
        assert ws["state"] == "FAILED"
        assert ws["reason"] == reason
        # The VMM still runs on the node and keeps its Allocation; start is refused.
        assert sim.instances[ws["instance_id"]].instance_id == ws["instance_id"]
        assert ctrl.runtime.index.allocated("node-a")[0] == 1500
        await ctrl.action(wid, "start", code="failed_precondition")
        # kibo workspace stop --force: the node stops this VMM (short sync) and releases.
        sim.refuse_stop = None
        await ctrl.action(wid, "stop", force=True)
        ws = await ctrl.settled(wid)
        assert ws["state"] == "STOPPED"
        assert ws["instance"]["confirmed_on_disk"] is False  # not confirmed on disk
        assert ctrl.runtime.index.allocated("node-a") == (0, 0)
        force = [c for c in sim.commands if c["kind"] == "instance.stop"][-1]
        assert force["args"]["force"] is True
        # Volumes and the writable layer are kept: the next start reuses the layer.
        await ctrl.action(wid, "start")
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"
        start = [c for c in sim.commands if c["kind"] == "instance.create"][-1]
        assert start["args"]["layer"]["create"] is False


async def test_a_node_that_no_longer_has_the_instance(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    """"If the node no longer has this Instance (for example, the node restarted and did
    not adopt it), ctrl releases the resources on its own, the Workspace stays FAILED,
    and you can start it directly"."""
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        ws = await ctrl.settled((await ctrl.create(cpu_millis=1500))["workspace_id"])
        wid, sim = ws["workspace_id"], ctrl.sims["node-a"]
        sim.refuse_stop = FailedPrecondition(REASONS[0])
        await ctrl.action(wid, "stop")
        assert (await ctrl.settled(wid))["state"] == "FAILED"
        await ctrl.disconnect("node-a")
        del sim.instances[ws["instance_id"]]  # the restarted node did not adopt it
        sim.refuse_stop = None
        await ctrl.connect("node-a", sim=sim)

        async def released() -> bool:
            return ctrl.runtime.index.allocated("node-a") == (0, 0)

        await wait_until(released, "ctrl released the Allocation on its own")
        assert (await ctrl.ws(wid))["state"] == "FAILED"
        await ctrl.action(wid, "start")
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"


async def test_retrying_a_refused_reclaim_with_the_same_command_id_continues_it(
        tmp_path: Path, autojump_clock: ThreadAwareClock) -> None:
    """The row "Reclaiming such an Instance fails with … stop instance process this node
    did not take over": after the operator stopped the unit they confirmed, "retry the
    original command with the same --command-id" must stop the Workspace, not replay the
    stored answer of the attempt the node refused."""
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        ws = await ctrl.settled((await ctrl.create(cpu_millis=1500))["workspace_id"])
        wid, sim = ws["workspace_id"], ctrl.sims["node-a"]
        sim.refuse_stop = FailedPrecondition(
            "stop instance process this node did not take over: unit kibotos-vmm-x.service "
            "(MainPID 42) of Instance x: the launch record is for Instance y; the unit "
            "keeps running")
        first = await ctrl.action(wid, "stop", force=True, command_id="reclaim-1")
        assert first["state"] == "STOPPING"
        ws = await ctrl.settled(wid)
        assert ws["state"] == "FAILED"
        assert "did not take over" in ws["reason"]
        sim.refuse_stop = None  # the operator stopped only that unit
        # Other input under the same ID is still refused.
        await ctrl.action(wid, "stop", command_id="reclaim-1", code="already_exists")
        again = await ctrl.action(wid, "stop", force=True, command_id="reclaim-1")
        assert again["state"] == "STOPPING"
        assert again["revision"] > first["revision"]
        ws = await ctrl.settled(wid)
        assert ws["state"] == "STOPPED"
        assert ws["instance"]["confirmed_on_disk"] is False
        assert ctrl.runtime.index.allocated("node-a") == (0, 0)
        stops = [c for c in sim.commands if c["kind"] == "instance.stop"]
        assert len(stops) == 2
        # Once done, the same ID replays the stored answer and changes nothing.
        replay = await ctrl.action(wid, "stop", force=True, command_id="reclaim-1")
        assert replay["revision"] == first["revision"]
        assert (await ctrl.ws(wid))["state"] == "STOPPED"
        assert len([c for c in sim.commands if c["kind"] == "instance.stop"]) == 2
