"""The storage commands through a running node's Instance manager: a Volume or layer a
live Instance holds is not deleted, expanded or copied; an object a storage command is
working on is not opened by a new Instance; the manager counts a created Volume of its
private pool as held."""

from __future__ import annotations

import pytest
from instance_harness import running_node

from kibotos.core.errors import FailedPrecondition

MIB = 1 << 20


async def test_a_live_instance_holds_its_volume_and_layer() -> None:
    async with running_node() as node:
        vol = {"volume_id": "vol-1", "pool_id": "pool-a", "capacity_bytes": 64 * MIB,
               "epoch": 1}
        assert await node.command("volume.create", vol) == {"created": True}
        assert node.manager.holdings().volume_count == 1  # private pool: still its own
        args = node.create_args(volumes=[{"volume_id": "vol-1", "pool_id": "pool-a",
                                          "epoch": 1, "mount_point": "/data"}])
        assert await node.command("instance.create", args) == {"accepted": True}
        await node.wait_state("inst-1", "RUNNING")
        with pytest.raises(FailedPrecondition, match="in use by Instance inst-1"):
            await node.command("volume.delete", {"volume_id": "vol-1", "pool_id": "pool-a",
                                                 "epoch": 1})
        with pytest.raises(FailedPrecondition, match="in use by Instance inst-1"):
            await node.command("object.expand", {
                "kind": "volume", "pool_id": "pool-a", "object_id": "vol-1", "epoch": 1,
                "capacity_bytes": 128 * MIB})
        with pytest.raises(FailedPrecondition, match="in use by Instance inst-1"):
            await node.command("object.expand", {
                "kind": "retained_layer", "pool_id": "pool-a", "object_id": "ws-1",
                "epoch": 1, "capacity_bytes": 128 * MIB})
        assert (node.pool / "volumes" / "data" / "vol-1.ext4").stat().st_size == 64 * MIB
        await node.command("instance.stop", {"instance_id": "inst-1"})
        # stopped: the layer grows, the Volume goes
        assert await node.command("object.expand", {
            "kind": "retained_layer", "pool_id": "pool-a", "object_id": "ws-1", "epoch": 1,
            "capacity_bytes": 128 * MIB}) == {"capacity_bytes": 128 * MIB}
        assert await node.command("volume.delete", {"volume_id": "vol-1", "pool_id": "pool-a",
                                                    "epoch": 1}) == {"deleted": True}
        assert not (node.pool / "volumes" / "data" / "vol-1.ext4").exists()


async def test_a_busy_object_refuses_a_new_instance() -> None:
    async with running_node() as node:
        key = ("retained-layers", "pool-a", "ws-1")
        with node.manager.storage._working("expanded", key):
            with pytest.raises(FailedPrecondition, match="being expanded"):
                await node.command("instance.create", node.create_args())
            assert node.manager.get("inst-1") is None
        assert await node.command("instance.create", node.create_args()) == {"accepted": True}
        await node.wait_state("inst-1", "RUNNING")
        await node.command("instance.destroy", {"instance_id": "inst-1"})


@pytest.mark.parametrize(("mount", "match"), [
    ("data", "absolute"), ("/data/../etc", "normalised"), ("/etc", "system directory"),
    ("/a//b", "normalised"), ("/a,b", "backslash"),
])
async def test_bad_mount_points_are_refused(mount: str, match: str) -> None:
    async with running_node() as node:
        args = node.create_args(volumes=[{"volume_id": "vol-1", "pool_id": "pool-a",
                                          "epoch": 1, "mount_point": mount}])
        from kibotos.core.errors import InvalidArgument
        with pytest.raises(InvalidArgument, match=match):
            await node.command("instance.create", args)
        assert node.manager.get("inst-1") is None


async def test_a_busy_layer_is_not_deleted() -> None:
    async with running_node() as node:
        key = ("retained-layers", "pool-a", "ws-1")
        with node.manager.storage._working("expanded", key), \
                pytest.raises(FailedPrecondition, match="being expanded"):
            await node.command("layer.delete", {"pool_id": "pool-a", "ref": "ws-1",
                                                "epoch": 1})
        assert await node.command("layer.delete", {"pool_id": "pool-a", "ref": "ws-1",
                                                   "epoch": 1}) == {"deleted": True}
