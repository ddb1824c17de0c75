"""A Volume through the node with a real microVM (``qemu``, TCG): ``volume.create``, an
Instance with the Volume at a chosen mount point (the node hands its device to the
guest's configure), a file written there, read back from the block file with debugfs
after the stop, ``object.expand`` on the stopped Volume, and the next Instance sees the
file on the larger file system."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import trio
from test_vm_node_instance import qemu_node, run_in_guest, wait_state
from vm_node_harness import template_blobs

from kibotos.node.instances.contract import FAILED, RUNNING
from kibotos.platform.images import read_file

pytestmark = [pytest.mark.slow, pytest.mark.qemu]
MIB = 1 << 20


def create_args(instance_id: str, template: dict[str, str], *, create: bool) -> dict:
    return {"instance_id": instance_id, "workspace_id": "ws-vol", "template": template,
            "cpu_millis": 1000, "memory_bytes": 256 << 20,
            "layer": {"pool_id": "pool-a", "ref": "ws-vol", "capacity_bytes": 256 * MIB,
                      "epoch": 1, "create": create},
            "volumes": [{"volume_id": "vol-data", "pool_id": "pool-a", "epoch": 1,
                         "mount_point": "/srv/data"}],
            "launch": {"hostname": "vol-box", "env": {}}}


async def test_a_volume_is_mounted_written_expanded_and_kept(platform_dir: Path,
                                                             template_dir: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="knvv-", dir="/tmp"))
    try:
        template = template_blobs(base / "artifacts", platform_dir, template_dir)
        async with qemu_node(base) as manager:
            h = manager.command_handlers()
            assert await h["volume.create"]({"volume_id": "vol-data", "pool_id": "pool-a",
                                             "capacity_bytes": 64 * MIB, "epoch": 1}) == \
                {"created": True}
            await h["instance.create"](create_args("inst-1", template, create=True))
            running = await wait_state(manager, "inst-1", RUNNING, FAILED)
            assert running["state"] == RUNNING, running
            mounts = await run_in_guest(manager, "inst-1", "cat /proc/mounts")
            assert b" /srv/data ext4 " in mounts, mounts
            await run_in_guest(manager, "inst-1", "echo on-volume > /srv/data/v.txt")
            await h["instance.stop"]({"instance_id": "inst-1", "deadline_s": 30})
            image = base / "pool" / "volumes" / "data" / "vol-data.ext4"
            assert await trio.to_thread.run_sync(read_file, image, "/v.txt") == b"on-volume\n"

            assert await h["object.expand"]({
                "kind": "volume", "pool_id": "pool-a", "object_id": "vol-data", "epoch": 1,
                "capacity_bytes": 256 * MIB}) == {"capacity_bytes": 256 * MIB}

            await h["instance.create"](create_args("inst-2", template, create=False))
            assert (await wait_state(manager, "inst-2", RUNNING, FAILED))["state"] == RUNNING
            assert await run_in_guest(manager, "inst-2", "cat /srv/data/v.txt") == \
                b"on-volume\n"
            size = await run_in_guest(manager, "inst-2", "df -k /srv/data | tail -1")
            total_k = int(size.split()[1])
            assert total_k > 200 * 1024, size  # the guest sees the grown file system
            await h["instance.destroy"]({"instance_id": "inst-2"})
    finally:
        shutil.rmtree(base, ignore_errors=True)
