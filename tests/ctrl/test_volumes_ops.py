"""Expansions and moves of Volumes and writable layers through a real ctrl with
simulated nodes: the Workspace must be stopped and cannot start meanwhile, the node
gets ``object.expand`` / ``object.copy`` with the use right's epoch, capacity is
reserved, a failed expansion is recorded and the next one may not go below its target,
a move with no node attached to both pools is ``failed_precondition``, and after a move
the record, the use right and the next start use the new pool while the old copy is
deleted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from ctrl_helpers import wait_until
from volume_helpers import create_volume, kinds, settled_volume, volume
from ws_helpers import GI, WsCtrl, open_ws_ctrl

from kibotos.core.errors import FailedPrecondition, Internal
from kibotos.ctrl.wire.volumes import LayerStatusOut, VolumeOut
from kibotos.testing.clock import ThreadAwareClock
from kibotos.testing.sim_instances import SimInstances

SHARED = {"id": "shared-a", "shared": True, "default": False}


async def layer(ctrl: WsCtrl, workspace_id: str) -> dict[str, Any]:
    got = dict(await ctrl.call("GET", f"/v1/workspaces/{workspace_id}/layer"))
    LayerStatusOut.model_validate(got)
    return got


async def layer_settled(ctrl: WsCtrl, workspace_id: str) -> dict[str, Any]:
    with trio.fail_after(30):
        while True:
            got = await layer(ctrl, workspace_id)
            if got["operation"] is None or got["operation"]["status"] == "failed":
                return got
            await trio.sleep(0.05)


async def stopped_workspace(ctrl: WsCtrl, **body: Any) -> str:
    wid = str((await ctrl.create(**body))["workspace_id"])
    await ctrl.settled(wid)
    await ctrl.action(wid, "stop")
    assert (await ctrl.settled(wid))["state"] == "STOPPED"
    return wid


async def test_expand_volume_needs_a_stopped_workspace(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        vid = (await create_volume(ctrl))["volume_id"]
        await settled_volume(ctrl, vid)
        wid = str((await ctrl.create(volumes=[{"volume_id": vid}]))["workspace_id"])
        await ctrl.settled(wid)
        err = await ctrl.call("POST", f"/v1/volumes/{vid}/expand",
                              json={"capacity_bytes": 2 * GI}, code="failed_precondition")
        assert "stop it first" in err["message"]
        await ctrl.action(wid, "stop")
        await ctrl.settled(wid)
        # Shrinking is refused; the same size changes nothing.
        await ctrl.call("POST", f"/v1/volumes/{vid}/expand",
                        json={"capacity_bytes": GI // 2}, code="invalid_argument")
        same = await ctrl.call("POST", f"/v1/volumes/{vid}/expand",
                               json={"capacity_bytes": GI})
        assert same["operation"] is None
        sim = ctrl.sims["node-a"]
        sim.hold_objects = trio.Event()
        started = await ctrl.call("POST", f"/v1/volumes/{vid}/expand",
                                  json={"capacity_bytes": 3 * GI, "command_id": "x-1"})
        VolumeOut.model_validate(started)
        assert started["operation"]["op"] == "expand"
        assert started["operation"]["status"] == "running"
        # While it runs, the Workspace cannot start and the Volume cannot be deleted.
        err = await ctrl.action(wid, "start", code="failed_precondition")
        assert "being expanded" in err["message"]
        sim.hold_objects.set()
        vol = await settled_volume(ctrl, vid)
        assert vol["operation"] is None, vol  # (a failed operation says why)
        assert vol["capacity_bytes"] == 3 * GI, vol
        assert kinds(sim, "object.expand") == [
            {"kind": "volume", "pool_id": "node-a-local", "object_id": vid, "epoch": 1,
             "capacity_bytes": 3 * GI}]
        assert sim.objects[("volume", "node-a-local", vid)].capacity_bytes == 3 * GI
        # A replay of the command returns the stored answer and starts nothing new.
        await ctrl.call("POST", f"/v1/volumes/{vid}/expand",
                        json={"capacity_bytes": 3 * GI, "command_id": "x-1"})
        assert len(kinds(sim, "object.expand")) == 1
        await ctrl.action(wid, "start")
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"


async def test_failed_expansion_is_kept_and_bounds_the_next(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path, pool_capacity="8G") as ctrl:
        await ctrl.connect("node-a")
        vid = (await create_volume(ctrl))["volume_id"]
        await settled_volume(ctrl, vid)
        sim = ctrl.sims["node-a"]
        sim.fail_objects = Internal("storage object expansion: resize2fs timed out")
        await ctrl.call("POST", f"/v1/volumes/{vid}/expand", json={"capacity_bytes": 4 * GI})
        vol = await settled_volume(ctrl, vid)
        assert vol["capacity_bytes"] == GI
        assert vol["operation"]["status"] == "failed"
        assert "resize2fs timed out" in vol["operation"]["error"]
        # The failed target stays reserved: 4 of 8 GiB.
        await create_volume(ctrl, code="resource_exhausted", capacity_bytes=5 * GI)
        err = await ctrl.call("POST", f"/v1/volumes/{vid}/expand",
                              json={"capacity_bytes": 2 * GI}, code="invalid_argument")
        assert "at least" in err["message"]
        await ctrl.call("POST", f"/v1/volumes/{vid}/expand", json={"capacity_bytes": 4 * GI})
        vol = await settled_volume(ctrl, vid)
        assert vol["capacity_bytes"] == 4 * GI
        assert vol["operation"] is None
        # More than the pool has left is refused before any node is asked.
        asked = len(kinds(sim, "object.expand"))
        await ctrl.call("POST", f"/v1/volumes/{vid}/expand",
                        json={"capacity_bytes": 9 * GI}, code="resource_exhausted")
        assert len(kinds(sim, "object.expand")) == asked


async def test_expand_layer(tmp_path: Path, autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        running = str((await ctrl.create(layer_size_bytes=GI))["workspace_id"])
        await ctrl.settled(running)
        await ctrl.call("POST", f"/v1/workspaces/{running}/expand-layer",
                        json={"capacity_bytes": 2 * GI}, code="failed_precondition")
        wid = await stopped_workspace(ctrl, layer_size_bytes=GI)
        ws = await ctrl.ws(wid)
        await ctrl.call("POST", f"/v1/workspaces/{wid}/expand-layer",
                        json={"capacity_bytes": 2 * GI, "expected_version": 999},
                        code="aborted")
        await ctrl.call("POST", f"/v1/workspaces/{wid}/expand-layer",
                        json={"capacity_bytes": 2 * GI,
                              "expected_version": ws["revision"]})
        status = await layer_settled(ctrl, wid)
        assert status["size_bytes"] == 2 * GI
        ref = ws["layer"]["ref"]
        assert kinds(ctrl.sims["node-a"], "object.expand") == [
            {"kind": "retained_layer", "pool_id": "node-a-local", "object_id": ref,
             "epoch": 1, "capacity_bytes": 2 * GI}]
        await ctrl.action(wid, "start")
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"
        start = kinds(ctrl.sims["node-a"], "instance.create")[-1]
        assert start["layer"]["capacity_bytes"] == 2 * GI


async def test_move_needs_a_node_attached_to_both_pools(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        objects: dict[Any, Any] = {}
        await ctrl.connect("node-a", sim=SimInstances(objects=objects))
        await ctrl.connect("node-b", pools=[
            {"id": "node-b-local", "shared": False, "default": True}, SHARED],
            sim=SimInstances(objects=objects))
        vid = (await create_volume(ctrl, pool_id="node-a-local"))["volume_id"]
        await settled_volume(ctrl, vid)
        err = await ctrl.call("POST", f"/v1/volumes/{vid}/move",
                              json={"pool_id": "shared-a"}, code="failed_precondition")
        assert "no node connects to both pools node-a-local and shared-a" in err["message"]
        assert (await volume(ctrl, vid))["pool_id"] == "node-a-local"
        assert kinds(ctrl.sims["node-a"], "object.copy") == []
        await ctrl.call("POST", f"/v1/volumes/{vid}/move", json={"pool_id": "node-a-local"},
                        code="failed_precondition")


async def test_move_volume_and_layer_then_start_elsewhere(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        objects: dict[Any, Any] = {}
        await ctrl.connect("node-a", pools=[
            {"id": "node-a-local", "shared": False, "default": True}, SHARED],
            sim=SimInstances(objects=objects))
        await ctrl.connect("node-b", pools=[
            {"id": "node-b-local", "shared": False, "default": True}, SHARED],
            sim=SimInstances(objects=objects))
        vid = (await create_volume(ctrl, pool_id="node-a-local"))["volume_id"]
        await settled_volume(ctrl, vid)
        wid = await stopped_workspace(ctrl, node_id="node-a",
                                      volumes=[{"volume_id": vid, "mount_point": "/data"}])
        # Private pool objects: node-b cannot start it.
        await ctrl.action(wid, "start", code="failed_precondition", node_id="node-b")
        moved = await ctrl.call("POST", f"/v1/volumes/{vid}/move",
                                json={"pool_id": "shared-a"})
        assert moved["operation"]["op"] == "move"
        vol = await settled_volume(ctrl, vid)
        assert vol["pool_id"] == "shared-a"
        assert vol["holder_node_id"] is None  # shared pool: released once moved
        sim_a = ctrl.sims["node-a"]
        assert kinds(sim_a, "object.copy") == [
            {"kind": "volume", "object_id": vid, "from_pool_id": "node-a-local",
             "to_pool_id": "shared-a", "epoch": 1}]
        assert kinds(sim_a, "volume.delete") == [
            {"volume_id": vid, "pool_id": "node-a-local", "epoch": 1}]
        assert ("volume", "shared-a", vid) in objects
        assert ("volume", "node-a-local", vid) not in objects
        ref = (await ctrl.ws(wid))["layer"]["ref"]
        await ctrl.call("POST", f"/v1/workspaces/{wid}/move-layer",
                        json={"pool_id": "shared-a"})
        status = await layer_settled(ctrl, wid)
        assert status["pool_id"] == "shared-a"
        assert status["operation"] is None
        assert ("node-a-local", ref) in [(p, r) for p, r, _ in sim_a.deleted_layers]
        # Both objects are in the shared pool now: node-b can start it, at a new epoch.
        await ctrl.action(wid, "start", node_id="node-b")
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"
        start = kinds(ctrl.sims["node-b"], "instance.create")[-1]
        assert start["layer"]["pool_id"] == "shared-a"
        assert start["layer"]["epoch"] == 2
        assert start["volumes"] == [{"volume_id": vid, "pool_id": "shared-a", "epoch": 2,
                                     "mount_point": "/data"}]


async def test_move_waits_for_the_copier_to_return(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        pools = [{"id": "node-a-local", "shared": False, "default": True}, SHARED]
        await ctrl.connect("node-a", pools=pools)
        vid = (await create_volume(ctrl))["volume_id"]
        await settled_volume(ctrl, vid)
        wid = await stopped_workspace(ctrl, volumes=[{"volume_id": vid}])
        sim = ctrl.sims["node-a"]
        sim.hold_objects = trio.Event()
        await ctrl.call("POST", f"/v1/volumes/{vid}/move", json={"pool_id": "shared-a"})

        async def asked() -> bool:
            return bool(kinds(sim, "object.copy"))

        await wait_until(asked, "object.copy sent")
        # `kibo workspace move` checks first: an object being moved stops it there.
        err = await ctrl.call("GET", f"/v1/workspaces/{wid}/move-check",
                              params={"node_id": "node-a"}, code="failed_precondition")
        assert "being moved" in err["message"]
        await ctrl.disconnect("node-a")
        sim.hold_objects.set()
        assert (await volume(ctrl, vid))["operation"]["status"] == "running"
        await ctrl.connect("node-a", pools=pools)
        vol = await settled_volume(ctrl, vid)
        assert vol["pool_id"] == "shared-a"
        assert vol["operation"] is None
        await ctrl.action(wid, "start")
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"


@pytest.mark.postgres
async def test_volume_create_attach_expand_move_on_postgresql(tmp_path: Path,
                                                              postgres_url: str,
        autojump_clock: ThreadAwareClock) -> None:
    """The same transactions on PostgreSQL (row locks, the journal's advisory lock)."""
    async with open_ws_ctrl(tmp_path, database_url=postgres_url) as ctrl:
        pools = [{"id": "node-a-local", "shared": False, "default": True}, SHARED]
        await ctrl.connect("node-a", pools=pools)
        vid = (await create_volume(ctrl, command_id="pg-1"))["volume_id"]
        assert (await settled_volume(ctrl, vid))["state"] == "AVAILABLE"
        wid = await stopped_workspace(ctrl, volumes=[{"volume_id": vid}])
        await ctrl.call("POST", f"/v1/volumes/{vid}/expand", json={"capacity_bytes": 2 * GI})
        assert (await settled_volume(ctrl, vid))["capacity_bytes"] == 2 * GI
        await ctrl.call("POST", f"/v1/volumes/{vid}/move", json={"pool_id": "shared-a"})
        assert (await settled_volume(ctrl, vid))["pool_id"] == "shared-a"
        await ctrl.action(wid, "start")
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"


async def test_busy_node_is_asked_again_not_failed(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
        autojump_clock: ThreadAwareClock) -> None:
    """An expansion asked again while the node still works on it (a session that
    dropped and came back) waits for it instead of recording a failure."""
    monkeypatch.setattr("kibotos.ctrl.live.volume_service.BUSY_PAUSE", 0.05)
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        vid = (await create_volume(ctrl))["volume_id"]
        await settled_volume(ctrl, vid)
        sim = ctrl.sims["node-a"]
        sim.fail_objects = FailedPrecondition("volume is being expanded on node-a",
                                              details={"reason": "object_busy"})
        await ctrl.call("POST", f"/v1/volumes/{vid}/expand", json={"capacity_bytes": 2 * GI})
        vol = await settled_volume(ctrl, vid)
        assert vol["operation"] is None
        assert vol["capacity_bytes"] == 2 * GI
        assert len(kinds(sim, "object.expand")) == 2


async def test_create_on_an_isolated_node_goes_to_another_at_a_new_epoch(
        tmp_path: Path, autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        objects: dict[Any, Any] = {}
        for node_id in ("node-a", "node-b"):
            await ctrl.connect(node_id, sim=SimInstances(objects=objects), pools=[
                {"id": f"{node_id}-local", "shared": False, "default": True}, SHARED])
        ctrl.sims["node-a"].hold_objects = trio.Event()
        vid = (await create_volume(ctrl, pool_id="shared-a"))["volume_id"]
        assert (await volume(ctrl, vid))["holder_node_id"] == "node-a"

        async def asked() -> bool:
            return bool(kinds(ctrl.sims["node-a"], "volume.create"))

        await wait_until(asked, "volume.create sent to node-a")
        await ctrl.disconnect("node-a")
        await ctrl.call("POST", "/v1/nodes/node-a/isolate",
                        json={"confirm_host_cannot_write": True})
        vol = await settled_volume(ctrl, vid)
        assert vol["state"] == "AVAILABLE"
        assert kinds(ctrl.sims["node-b"], "volume.create") == [
            {"volume_id": vid, "pool_id": "shared-a", "capacity_bytes": GI, "epoch": 2}]
        assert vol["epoch"] == 2
