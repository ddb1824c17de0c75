"""A node restart with a real microVM (``qemu`` backend, ``direct`` supervisor): the next
node process adopts the running VM (`kibotos.node.instances.adoption`) without restarting its
guest — the same QEMU process, the same guest boot ID read inside the guest, a file
written before the restart still there — and exec works right after."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from vm_node_harness import VM_SETTINGS, qemu_config, template_blobs

from kibotos.config import NodeConfig
from kibotos.node.instances.contract import FAILED, RUNNING
from kibotos.node.instances.manager import VmInstanceManager
from kibotos.node.instances.setup import build_instance_manager, supervisor_options
from kibotos.node.storage.pools.dirs import prepare_pool_dirs
from kibotos.node.storage.pools.marker import init_pool
from kibotos.plugins import load_plugins

pytestmark = [pytest.mark.slow, pytest.mark.qemu]
DEADLINE = 600


def _config(base: Path) -> NodeConfig:
    return qemu_config(base, "vm adoption test node.toml")


@asynccontextmanager
async def _node(base: Path) -> AsyncIterator[VmInstanceManager]:
    """A node process's manager over `base`; its VMs keep running when it ends."""
    manager = build_instance_manager(
        _config(base), memory_tight=lambda: False, registries=load_plugins(),
        settings=VM_SETTINGS)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        yield manager
        nursery.cancel_scope.cancel()


async def _frame(manager: VmInstanceManager, want: Any) -> dict[str, Any]:
    seen = 0
    with trio.fail_after(DEADLINE):
        while True:
            seen, frames = await manager.state_feed().after(seen)
            for frame in frames:
                if want(frame):
                    return frame


async def _run(manager: VmInstanceManager, script: str) -> bytes:
    inst = manager.get("inst-1")
    assert inst is not None
    async with manager.launcher.guest(inst, timeout=30) as guest:
        status, out, err = await guest.run(["sh", "-c", script])
    assert status.exit_code == 0, err
    return bytes(out)


async def test_a_node_restart_adopts_a_real_vm_without_a_guest_restart(
        platform_dir: Path, template_dir: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="kva-", dir="/tmp"))
    init_pool("pool-a", base / "pool")
    prepare_pool_dirs("pool-a", base / "pool")
    try:
        template = template_blobs(base / "artifacts", platform_dir, template_dir)
        args = {"instance_id": "inst-1", "workspace_id": "ws-vm", "template": template,
                "cpu_millis": 1000, "memory_bytes": 256 << 20,
                "layer": {"pool_id": "pool-a", "ref": "ws-vm", "capacity_bytes": 256 << 20,
                          "epoch": 1, "create": True},
                "launch": {"hostname": "vm-box", "env": {}}}
        async with _node(base) as manager:
            await manager.command_handlers()["instance.create"](args)
            running = await _frame(manager, lambda f: f["state"] in (RUNNING, FAILED))
            assert running["state"] == RUNNING, running
            boot_id = running["guest"]["boot_id"]
            main = manager.get("inst-1").main_process
            assert (await _run(manager, "cat /proc/sys/kernel/random/boot_id")).strip() \
                == boot_id.encode()
            await _run(manager, "echo before > /root/before.txt")

        async with _node(base) as manager:  # the restarted node
            inst = manager.get("inst-1")
            assert inst.state == RUNNING  # adopted at start, before the guest answered
            assert inst.main_process == main
            # exec right after the start, on the same guest boot
            assert (await _run(manager, "cat /proc/sys/kernel/random/boot_id")).strip() \
                == boot_id.encode()
            assert await _run(manager, "cat /root/before.txt; hostname") == \
                b"before\nvm-box\n"
            synced = await _frame(manager, lambda f: (f.get("guest") or {}).get(
                "responding") is True)
            assert synced["guest"]["boot_id"] == boot_id
            await manager.takeover.wait_idle()
            assert manager.get("inst-1").state == RUNNING
            assert await manager.command_handlers()["instance.destroy"](
                {"instance_id": "inst-1"}) == {"destroyed": True}
    finally:
        sup = load_plugins().supervisor.get("direct")(supervisor_options(_config(base)))
        with trio.CancelScope(shield=True):
            for info in await sup.list(""):
                await sup.stop(info.name, timeout=5)
        shutil.rmtree(base, ignore_errors=True)
