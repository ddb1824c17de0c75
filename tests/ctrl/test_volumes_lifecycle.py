"""Volumes through the real HTTP API of a real ctrl with simulated nodes: create (the
node gets ``volume.create`` with the epoch, the pool's capacity is checked), get, list,
delete (refused while attached), attach at Workspace create with mount points, the
Volume following its Workspace on start, detach at Workspace delete, placement on a
node attached to the Volume's pool, and resumption after the node was away."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import trio
from ctrl_helpers import wait_until
from volume_helpers import create_volume, kinds, settled_volume, volume
from ws_helpers import GI, open_ws_ctrl

from kibotos.core.errors import Aborted, Internal
from kibotos.ctrl.pools import volume_txns as vt
from kibotos.ctrl.wire.volumes import VolumeListOut, VolumeOut
from kibotos.testing.clock import ThreadAwareClock
from kibotos.testing.sim_instances import SimInstances

MI = 1 << 20


async def test_create_get_list_delete(tmp_path: Path, autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        created = await create_volume(ctrl, labels={"team": "ml"}, command_id="v-1")
        VolumeOut.model_validate(created)
        vid = created["volume_id"]
        assert vid.startswith("vol-")
        assert len(vid) <= 32
        assert created["state"] == "CREATING"
        assert created["pool_id"] == "node-a-local"  # the one default pool
        assert created["holder_node_id"] == "node-a"
        assert created["epoch"] == 1
        vol = await settled_volume(ctrl, vid)
        assert vol["state"] == "AVAILABLE"
        assert vol["holder_node_id"] == "node-a"  # private pool: the node keeps it
        assert kinds(ctrl.sims["node-a"], "volume.create") == [
            {"volume_id": vid, "pool_id": "node-a-local", "capacity_bytes": GI, "epoch": 1}]
        assert ctrl.sims["node-a"].objects[("volume", "node-a-local", vid)].capacity_bytes \
            == GI
        # The same command ID replays the stored result; other input is refused.
        again = await create_volume(ctrl, labels={"team": "ml"}, command_id="v-1")
        assert again["volume_id"] == vid
        await create_volume(ctrl, code="already_exists", command_id="v-1")
        listed = await ctrl.call("GET", "/v1/volumes")
        VolumeListOut.model_validate(listed)
        assert [v["volume_id"] for v in listed["volumes"]] == [vid]
        assert (await ctrl.call("GET", "/v1/volumes", params={"pool_id": "other"})
                )["volumes"] == []
        # A stale revision is refused, nothing changes.
        await ctrl.call("POST", f"/v1/volumes/{vid}/delete",
                        json={"expected_version": vol["revision"] + 5}, code="aborted")
        deleting = await ctrl.call("POST", f"/v1/volumes/{vid}/delete",
                                   json={"expected_version": vol["revision"]})
        assert deleting["state"] == "DELETING"
        gone = await settled_volume(ctrl, vid)
        assert gone["state"] == "DELETED"
        assert gone["deleted_at"] is not None
        assert kinds(ctrl.sims["node-a"], "volume.delete") == [
            {"volume_id": vid, "pool_id": "node-a-local", "epoch": 1}]
        assert ("volume", "node-a-local", vid) not in ctrl.sims["node-a"].objects
        assert (await ctrl.call("GET", "/v1/volumes"))["volumes"] == []
        listed = await ctrl.call("GET", "/v1/volumes", params={"deleted": "true"})
        assert [v["state"] for v in listed["volumes"]] == ["DELETED"]


async def test_bad_input_writes_nothing(tmp_path: Path, autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        for body in ({"capacity_bytes": GI + 1}, {"capacity_bytes": MI},
                     {"capacity_bytes": GI, "pool_id": "Bad_Pool"},
                     {"capacity_bytes": GI, "colour": "red"}):
            err = await ctrl.call("POST", "/v1/volumes", json=body, code="invalid_argument")
            assert err["message"].startswith("invalid request")
        for bad in ("Vol-X", "-x", "a" * 33):
            await ctrl.call("GET", f"/v1/volumes/{bad}", code="invalid_argument")
        await ctrl.call("GET", "/v1/volumes/vol-nothere", code="not_found")
        assert (await ctrl.call("GET", "/v1/volumes"))["volumes"] == []
        assert ctrl.sims["node-a"].commands == []


async def test_capacity_is_checked_and_no_node_is_asked(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path, pool_capacity="2G") as ctrl:
        await ctrl.connect("node-a")
        await settled_volume(ctrl, (await create_volume(ctrl))["volume_id"])
        err = await create_volume(ctrl, code="resource_exhausted", capacity_bytes=2 * GI)
        assert "node-a-local" in err["message"]
        assert err["details"]["reason"] == "capacity_exceeded"
        assert len(kinds(ctrl.sims["node-a"], "volume.create")) == 1
        # A pool nobody is attached to: no node can create it.
        err = await create_volume(ctrl, code="failed_precondition", pool_id="elsewhere")
        assert "no live node attached to pool elsewhere" in err["message"]


async def test_node_refusal_fails_the_volume(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        ctrl.sims["node-a"].fail_objects = Internal("mkfs.ext4 failed: disk full")
        created = await create_volume(ctrl)
        vol = await settled_volume(ctrl, created["volume_id"])
        assert vol["state"] == "FAILED"
        assert "mkfs.ext4 failed" in vol["reason"]
        # A FAILED Volume can be deleted (the node deletes whatever is left).
        await ctrl.call("POST", f"/v1/volumes/{vol['volume_id']}/delete", json={})
        assert (await settled_volume(ctrl, vol["volume_id"]))["state"] == "DELETED"


async def test_a_held_object_lock_is_retried_not_a_failure(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    """``aborted`` (the node's object lock is held, retryable) means "not done yet":
    ctrl asks again and the Volume becomes AVAILABLE, not FAILED."""
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        sim = ctrl.sims["node-a"]
        sim.fail_objects = Aborted("Volume operation lock is held",
                                   details={"reason": "object_lock_held"})
        created = await create_volume(ctrl)
        vol = await settled_volume(ctrl, created["volume_id"])
        assert vol["state"] == "AVAILABLE", vol
        assert len(kinds(sim, "volume.create")) == 2


async def test_create_resumes_when_the_node_returns(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        sim = ctrl.sims["node-a"]
        sim.hold_objects = trio.Event()
        created = await create_volume(ctrl)
        vid = created["volume_id"]

        async def asked() -> bool:
            return bool(kinds(sim, "volume.create"))

        await wait_until(asked, "volume.create sent")
        await ctrl.disconnect("node-a")
        sim.hold_objects.set()
        assert (await volume(ctrl, vid))["state"] == "CREATING"
        await ctrl.connect("node-a")
        vol = await settled_volume(ctrl, vid)
        assert vol["state"] == "AVAILABLE"
        assert all(a["epoch"] == 1 for a in kinds(sim, "volume.create"))


async def test_attach_start_follow_and_detach(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        v1 = (await create_volume(ctrl))["volume_id"]
        v2 = (await create_volume(ctrl))["volume_id"]
        await settled_volume(ctrl, v1)
        await settled_volume(ctrl, v2)
        # Bad attachments are refused before anything is placed.
        await ctrl.create(code="invalid_argument",
                          volumes=[{"volume_id": v1, "mount_point": "data"}])
        await ctrl.create(code="invalid_argument",
                          volumes=[{"volume_id": v1, "mount_point": "/etc"}])
        await ctrl.create(code="invalid_argument", volumes=[{"volume_id": v1},
                                                            {"volume_id": v1}])
        await ctrl.create(code="not_found", volumes=[{"volume_id": "vol-nothere"}])
        ws = await ctrl.create(volumes=[{"volume_id": v1, "mount_point": "/data"},
                                        {"volume_id": v2}])
        wid = ws["workspace_id"]
        await ctrl.settled(wid)
        create = kinds(ctrl.sims["node-a"], "instance.create")[-1]
        assert create["volumes"] == [
            {"volume_id": v1, "pool_id": "node-a-local", "epoch": 1, "mount_point": "/data"},
            {"volume_id": v2, "pool_id": "node-a-local", "epoch": 1,
             "mount_point": f"/mnt/{v2}"}]
        vol = await volume(ctrl, v1)
        assert vol["workspace_id"] == wid
        assert vol["mount_point"] == "/data"
        listed = await ctrl.call("GET", "/v1/volumes", params={"workspace_id": wid})
        assert sorted(v["volume_id"] for v in listed["volumes"]) == sorted([v1, v2])
        # Attached: another Workspace cannot take it, and it cannot be deleted.
        err = await ctrl.create(code="failed_precondition", volumes=[{"volume_id": v1}])
        assert wid in err["message"]
        err = await ctrl.call("POST", f"/v1/volumes/{v1}/delete", json={},
                              code="failed_precondition")
        assert "attached to workspace" in err["message"]
        # The Volumes follow the Workspace on start, with their mount points.
        await ctrl.action(wid, "stop")
        await ctrl.settled(wid)
        await ctrl.action(wid, "start")
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"
        start = kinds(ctrl.sims["node-a"], "instance.create")[-1]
        assert start["layer"]["create"] is False
        assert {v["volume_id"]: v["mount_point"] for v in start["volumes"]} == {
            v1: "/data", v2: f"/mnt/{v2}"}
        # Deleting the Workspace detaches the Volumes and keeps them.
        await ctrl.action(wid, "stop")
        await ctrl.settled(wid)
        await ctrl.action(wid, "delete")
        assert (await ctrl.settled(wid))["state"] == "DELETED"
        vol = await volume(ctrl, v1)
        assert vol["state"] == "AVAILABLE"
        assert vol["workspace_id"] is None
        assert vol["mount_point"] is None
        assert ("volume", "node-a-local", v1) in ctrl.sims["node-a"].objects
        assert kinds(ctrl.sims["node-a"], "volume.delete") == []
        # ... and attachable again.
        ws2 = await ctrl.create(volumes=[{"volume_id": v1}])
        assert (await ctrl.settled(ws2["workspace_id"]))["state"] == "AVAILABLE"


async def test_placement_requires_the_volume_pool(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    shared = {"id": "shared-a", "shared": True, "default": False}
    async with open_ws_ctrl(tmp_path) as ctrl:
        objects: dict[Any, Any] = {}
        await ctrl.connect("node-a", pools=[
            {"id": "node-a-local", "shared": False, "default": True}, shared],
            sim=SimInstances(objects=objects))
        await ctrl.connect("node-b", sim=SimInstances(objects=objects))
        vid = (await create_volume(ctrl, pool_id="shared-a"))["volume_id"]
        vol = await settled_volume(ctrl, vid)
        assert vol["holder_node_id"] is None  # shared pool: released after the create
        # node-b is not attached to shared-a: pinning it there is refused.
        err = await ctrl.create(code="failed_precondition", node_id="node-b",
                                volumes=[{"volume_id": vid}])
        assert "not attached to pool shared-a" in err["message"]
        # Unpinned, it goes to node-a, whatever the policy would prefer.
        for _ in range(3):
            ws = await ctrl.create(volumes=[{"volume_id": vid}])
            assert ws["node_id"] == "node-a"
            await ctrl.settled(ws["workspace_id"])
            await ctrl.action(ws["workspace_id"], "stop")
            await ctrl.settled(ws["workspace_id"])
            await ctrl.action(ws["workspace_id"], "delete")
            await ctrl.settled(ws["workspace_id"])
        epochs = [v["epoch"] for a in kinds(ctrl.sims["node-a"], "instance.create")
                  for v in a["volumes"]]
        assert epochs == [1, 1, 1]  # always the node that created it: no new epoch


async def test_sweep_resumes_a_create_without_a_task(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    """What a ctrl restart finds: a Volume recorded CREATING whose task is gone; the
    Workspace service's sweep starts one."""
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        await ctrl.ctx.store.write(partial(
            vt.begin_create, volume_id="vol-orphan", pool_id="node-a-local", shared=False,
            capacity_bytes=GI, labels={}, node_id="node-a", now=ctrl.ctx.now(),
            default_capacity=1 << 40))
        vol = await settled_volume(ctrl, "vol-orphan")
        assert vol["state"] == "AVAILABLE"
        assert kinds(ctrl.sims["node-a"], "volume.create") == [
            {"volume_id": "vol-orphan", "pool_id": "node-a-local", "capacity_bytes": GI,
             "epoch": 1}]
