"""The node's Instance manager booting real microVMs through the ``qemu`` backend and
the ``direct`` supervisor: create → RUNNING, a file written in the guest, a normal stop
(stop_prepare freezes the writable layer, then the VMM stops), the file read back from
the layer, a second Instance on the same layer sees it, destroy leaves nothing running.

The Platform and ``kibotos-base`` are the session fixtures of this directory's
conftest; their blobs are offered to the node by digest in a local artifact directory,
as the node's template cache would hold them."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from vm_node_harness import VM_SETTINGS, qemu_config, template_blobs

from kibotos.core import atomicfile
from kibotos.node.instances.contract import FAILED, RUNNING, STOPPED
from kibotos.node.instances.manager import VmInstanceManager
from kibotos.node.instances.setup import build_instance_manager, supervisor_options
from kibotos.node.storage.pools.dirs import prepare_pool_dirs
from kibotos.node.storage.pools.marker import init_pool
from kibotos.platform.images import read_file
from kibotos.plugins import load_plugins

pytestmark = [pytest.mark.slow, pytest.mark.qemu]
DEADLINE = 600


@asynccontextmanager
async def qemu_node(base: Path) -> AsyncIterator[VmInstanceManager]:
    init_pool("pool-a", base / "pool")
    prepare_pool_dirs("pool-a", base / "pool")
    config = qemu_config(base, "vm test node.toml")
    manager = build_instance_manager(
        config, memory_tight=lambda: False, registries=load_plugins(),
        settings=VM_SETTINGS)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(manager.run)
            yield manager
            nursery.cancel_scope.cancel()
    finally:
        sup = load_plugins().supervisor.get("direct")(supervisor_options(config))
        with trio.CancelScope(shield=True):
            for info in await sup.list(""):
                await sup.stop(info.name, timeout=5)


async def wait_state(manager: VmInstanceManager, instance_id: str, *states: str
                     ) -> dict[str, Any]:
    seen = 0
    with trio.fail_after(DEADLINE):
        while True:
            seen, frames = await manager.state_feed().after(seen)
            for frame in frames:
                if frame["instance_id"] == instance_id and frame["state"] in states:
                    return frame


def create_args(instance_id: str, template: dict[str, str], *, create: bool
                ) -> dict[str, Any]:
    return {"instance_id": instance_id, "workspace_id": "ws-vm", "template": template,
            "cpu_millis": 1000, "memory_bytes": 256 << 20,
            "layer": {"pool_id": "pool-a", "ref": "ws-vm", "capacity_bytes": 256 << 20,
                      "epoch": 1, "create": create},
            "launch": {"hostname": "vm-box", "env": {}}}


async def run_in_guest(manager: VmInstanceManager, instance_id: str, script: str
                       ) -> bytes:
    inst = manager.get(instance_id)
    assert inst is not None
    async with manager.launcher.guest(inst, timeout=30) as guest:
        status, out, err = await guest.run(["sh", "-c", script])
    assert status.exit_code == 0, err
    return out


def gone(pid: int, ticks: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[19]) != ticks or fields[0] in "ZXx"


async def test_a_real_vm_through_create_stop_restart_destroy(platform_dir: Path,
                                                             template_dir: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="knv-", dir="/tmp"))
    try:
        template = template_blobs(base / "artifacts", platform_dir, template_dir)
        async with qemu_node(base) as manager:
            handlers = manager.command_handlers()
            assert await handlers["instance.create"](create_args("inst-1", template,
                                                                 create=True)) == \
                {"accepted": True}
            running = await wait_state(manager, "inst-1", RUNNING, FAILED)
            assert running["state"] == RUNNING, running
            inst = manager.get("inst-1")
            record = atomicfile.read_json(inst.dir / "systemd.json")
            pid = record["unit"]["main_pid"]
            assert os.readlink(f"/proc/{pid}/exe").endswith("qemu-system-x86_64")
            assert record["guest"]["boot_id"] == running["guest"]["boot_id"]
            assert await run_in_guest(manager, "inst-1", "hostname") == b"vm-box\n"
            await run_in_guest(manager, "inst-1", "echo kept > /root/kept.txt")

            result = await handlers["instance.stop"]({"instance_id": "inst-1",
                                                      "deadline_s": 30})
            assert result == {"confirmed_on_disk": True}
            await wait_state(manager, "inst-1", STOPPED)
            assert gone(pid, record["unit"]["start_time_ticks"])
            layer = base / "pool" / "retained-layers" / "data" / "ws-vm.ext4"
            assert await trio.to_thread.run_sync(read_file, layer, "/upper/root/kept.txt") \
                == b"kept\n"

            # A new Instance (a new start) on the same layer sees the file.
            await handlers["instance.create"](create_args("inst-2", template, create=False))
            assert (await wait_state(manager, "inst-2", RUNNING, FAILED))["state"] == RUNNING
            assert await run_in_guest(manager, "inst-2", "cat /root/kept.txt") == b"kept\n"
            second = manager.get("inst-2")
            pid2, ticks2 = second.main_process
            await handlers["instance.destroy"]({"instance_id": "inst-1"})
            await handlers["instance.destroy"]({"instance_id": "inst-2"})
            assert gone(pid2, ticks2)
            assert list((base / "root" / "runtime" / "instances").iterdir()) == []
            assert (base / "root" / "machine-logs" / "inst-2" / "console.log").is_file()
            assert layer.is_file()
    finally:
        shutil.rmtree(base, ignore_errors=True)
