"""With several ctrl replicas a create may be in flight on another replica while the
node reports its Instance here (`kibotos.ctrl.live.node_feed`): an Instance this
replica has no record of is then set aside, and destroyed only if no record appears
within `FOREIGN_CREATE_WINDOW`.  One in-process ctrl plays the replica that has no
record; the autojump clock lets the window pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from ctrl_helpers import wait_until
from ws_helpers import away_with_one_lost_and_one_stray, open_ws_ctrl

from kibotos.ctrl.live.node_feed import FOREIGN_CREATE_WINDOW
from kibotos.protocol import Args
from kibotos.testing.clock import ThreadAwareClock
from kibotos.testing.sim_instances import SimInstances


async def test_an_unrecorded_instance_waits_out_the_window_before_it_is_destroyed(
        tmp_path: Path, autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        ctrl.runtime.foreign_creates = True
        await ctrl.connect("node-a")
        # While away the node lost one Instance and gained one this ctrl has no record
        # of: another replica's create, perhaps, whose record is not committed yet.
        kept, lost, sim = await away_with_one_lost_and_one_stray(ctrl)
        connected_at = trio.current_time()
        await ctrl.connect("node-a", sim=sim)

        async def lost_failed() -> bool:
            return (await ctrl.ws(lost["workspace_id"]))["state"] == "FAILED"

        # The hello's list was applied (the lost Instance is gone) ...
        await wait_until(lost_failed, "the lost Instance's Workspace FAILED")
        # ... but the unrecorded one is kept while a create elsewhere may record it,
        assert "inst-stray" not in sim.destroyed
        await trio.sleep(FOREIGN_CREATE_WINDOW / 2)
        assert "inst-stray" not in sim.destroyed
        # and destroyed once none did: nothing is left on the node for ever.
        await wait_until(lambda: "inst-stray" in sim.destroyed or None,
                         "the stray Instance destroyed", timeout=4 * FOREIGN_CREATE_WINDOW)
        assert trio.current_time() - connected_at >= FOREIGN_CREATE_WINDOW
        assert (await ctrl.ws(kept["workspace_id"]))["state"] == "AVAILABLE"


async def test_a_hello_during_a_create_in_flight_is_applied_after_the_create(
        tmp_path: Path) -> None:
    """The node accepted a create, its session ended before the create was recorded and
    its RUNNING frame went with it; the hello of its next session lists the Instance
    RUNNING while the create is still in flight.  That entry is applied once the create
    is recorded, so the Workspace becomes AVAILABLE (dropped, it stayed CREATING)."""
    async with open_ws_ctrl(tmp_path) as ctrl:
        sim = SimInstances(hold_boots=trio.Event())
        await ctrl.connect("node-a", sim=sim)
        hub = ctrl.ctx.sessions
        original = hub.call
        accepted, release = trio.Event(), trio.Event()

        async def held_call(node_id: str, args: Args, timeout: float) -> dict[str, object]:
            answer = await original(node_id, args, timeout)
            if args.KIND == "instance.create":
                accepted.set()
                await release.wait()  # the create in flight, not recorded yet
            return answer

        hub.call = held_call  # type: ignore[method-assign]
        created: dict[str, Any] = {}

        async def create() -> None:
            created.update(await ctrl.create())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(create)
            await accepted.wait()
            (instance_id,) = sim.instances
            await ctrl.disconnect("node-a")
            # It booted while away: its RUNNING frame was never delivered.
            sim.instances[instance_id].state = "RUNNING"
            await ctrl.connect("node-a", sim=sim, wait_eligible=False, incarnation=1)
            assert instance_id in ctrl.runtime.inflight
            release.set()
        ws = await ctrl.settled(created["workspace_id"], timeout=20)
        assert ws["state"] == "AVAILABLE", ws.get("reason")
        assert instance_id not in sim.destroyed
