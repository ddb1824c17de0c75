"""A stop or destroy whose VMM leaves a process SIGKILL cannot end (spec:
node-and-vmm-processes, Troubleshooting, "instance cleanup pending").

The ``stuckvmm`` backend leaves a child in the unit's process group that waits in the
kernel on a FUSE file system that never answers (`stuck_fuse.py`): a real
uninterruptible wait, as a VMM waiting on an unresponsive storage mount.  The node must
keep the Instance STOPPING, log ``instance cleanup pending`` on every attempt, tell
ctrl since when and what is still held, not release the writable layer, and finish the
release on its own once the file system answers."""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from instance_harness import (
    DEADLINE,
    FAST,
    Node,
    node_config,
    short_dir,
    stop_all_units,
    write_template,
)
from stuck_fuse_helpers import StuckFs

from kibotos.config import NodeConfig
from kibotos.core import atomicfile
from kibotos.core.errors import Unavailable
from kibotos.node.instances.contract import DESTROYED, FAILED, RUNNING, STOPPED, STOPPING
from kibotos.node.instances.setup import build_instance_manager
from kibotos.plugins import load_plugins

pytestmark = pytest.mark.skipif(not Path("/dev/fuse").exists() or shutil.which("mount")
                                is None, reason="needs /dev/fuse and mount(8)")


def _config(base: Path, stuck: Path) -> NodeConfig:
    return node_config(base, backend="stuckvmm", backend_options=f'stuck_path = "{stuck}"',
                       extra='[supervisor]\nbackend = "direct"\n[supervisor.direct]\n'
                             'kill_grace = 0.5\n')


@asynccontextmanager
async def stuck_node() -> AsyncIterator[tuple[Node, StuckFs]]:
    base = short_dir("kc-")
    mountpoint = base / "stuck"
    mountpoint.mkdir()
    config = _config(base, mountpoint / "block")
    fs = StuckFs(mountpoint)
    try:
        for sub in ("runtime", "template-cache", "machine-logs"):
            (config.storage.root / sub).mkdir(parents=True, exist_ok=True)
        template = write_template(base)
        manager = build_instance_manager(
            config, memory_tight=lambda: False,
            registries=load_plugins(test_modules=["kibotos_testvmm", "kibotos_stuckvmm"]),
            settings=FAST, receipt_wait=1.0)
        manager.cleanups.retry_s = 0.2
        manager.cleanups.command_wait_s = 0.5
        node = Node(base, config, manager, template)
        async with trio.open_nursery() as nursery:
            await nursery.start(manager.run)
            yield node, fs
            nursery.cancel_scope.cancel()
    finally:
        fs.release()  # before the units are stopped: nothing stays stuck
        with trio.CancelScope(shield=True):
            await stop_all_units(config)
        shutil.rmtree(base, ignore_errors=True)


def _lines(caplog: pytest.LogCaptureFixture, message: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kibotos.node" and r.getMessage().startswith(message + " ")]


async def _pending_frame(node: Node) -> dict[str, Any]:
    frame = await node.wait_state("inst-1", STOPPING)
    while "cleanup" not in frame:  # the first STOPPING frame is the stop's start
        feed = node.manager.state_feed()
        with trio.fail_after(DEADLINE):
            _, frames = await feed.after(0)
        frame = next(f for f in reversed(frames)
                     if f["instance_id"] == "inst-1" and f["state"] == STOPPING)
        await trio.sleep(0.05)
    return frame


@pytest.mark.parametrize("kind", ["instance.stop", "instance.destroy"])
async def test_a_stuck_vmm_process_keeps_the_release_pending_until_it_is_gone(
        kind: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kibotos.node")
    async with stuck_node() as (node, fs):
        assert await node.command("instance.create", node.create_args("inst-1")) == \
            {"accepted": True}
        assert (await node.wait_state("inst-1", RUNNING, FAILED))["state"] == RUNNING
        await fs.wait_held()
        args = {"instance_id": "inst-1"} | ({"force": True} if kind == "instance.stop"
                                           else {})
        with pytest.raises(Unavailable, match="instance cleanup pending since"):
            await node.command(kind, args)

        # STOPPING, with since when and what is held: the stuck process, the layer.
        frame = await _pending_frame(node)
        cleanup = frame["cleanup"]
        items = {h["item"] for h in cleanup["held"]}
        assert items == {"RUNTIME", "VOLUME_ATTACHMENT"}
        assert any("survived SIGKILL" in h["part"] for h in cleanup["held"])
        inst = node.manager.get("inst-1")
        assert inst is not None
        assert inst.state == STOPPING
        assert not inst.released
        meta = atomicfile.read_json(node.pool / "retained-layers" / "metadata" /
                                    "ws-1.json")
        assert meta["state"] == "attached"  # not released while a process may write

        # The node retries on its own, logging each attempt; a repeat of the command
        # answers unavailable again without a second retry loop.
        with trio.fail_after(DEADLINE):
            while len(_lines(caplog, "instance cleanup pending")) < 3:
                await trio.sleep(0.05)
        with pytest.raises(Unavailable, match=re.escape(
                "instance cleanup pending since " + cleanup["pending_since"])):
            await node.command(kind, args)
        assert _lines(caplog, "instance machine exited") == []

        # The storage answers: the process ends and the node finishes by itself.
        fs.release()
        final = STOPPED if kind == "instance.stop" else DESTROYED
        assert "cleanup" not in await node.wait_state("inst-1", final)
        assert node.manager.get("inst-1") is None
        assert await node.manager.launcher.supervisor.list("kibotos-vmm-") == []
        meta = atomicfile.read_json(node.pool / "retained-layers" / "metadata" /
                                    "ws-1.json")
        assert (meta["state"], meta["confirmed_on_disk"]) == ("released", False)
        entry = atomicfile.read_json(node.root / "runtime" / "registry" / "inst-1.json")
        assert entry["state"] == final
        assert entry["cleanup"]["RUNTIME"] == "RELEASED"
        exited = _lines(caplog, "instance machine exited")
        assert len(exited) == 1
        assert "instance=inst-1" in exited[0]
        # Now the command gets the final answer.
        again = await node.command(kind, args)
        assert again == ({"confirmed_on_disk": False} if kind == "instance.stop"
                         else {"destroyed": True})
