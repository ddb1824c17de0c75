"""A node (Instance manager, ``direct`` supervisor, ``testvmm`` backend) that stands for
a given release (`kibotos.node.runtime.build_identity.BuildIdentity`), for the installation,
check-maintenance, check-upgrade and upgrade tests; and a snapshot of a storage root
to prove a check wrote nothing."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from instance_harness import (
    DEADLINE,
    FAST,
    Node,
    node_config,
    registries,
    short_dir,
    stop_all_units,
    write_template,
)

from kibotos.node.instances.contract import FAILED, RUNNING
from kibotos.node.instances.setup import build_instance_manager
from kibotos.node.runtime.build_identity import BuildIdentity


@asynccontextmanager
async def node_at(base: Path, build: BuildIdentity, *, runtime_dir: Path | None = None,
                  backend_options: str = "") -> AsyncIterator[Node]:
    """A running manager on `base` (a restart when `base` has state) as `build`."""
    config = node_config(base, backend_options=backend_options)
    for sub in ("runtime", "template-cache", "machine-logs"):
        (config.storage.root / sub).mkdir(parents=True, exist_ok=True)
    template = write_template(base)
    tight = [False]
    manager = build_instance_manager(config, memory_tight=lambda: tight[0],
                                     registries=registries(), settings=FAST,
                                     receipt_wait=1.0, build=build, runtime_dir=runtime_dir)
    node = Node(base, config, manager, template, tight)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        yield node
        nursery.cancel_scope.cancel()


async def start(node: Node, instance_id: str, workspace_id: str) -> dict[str, Any]:
    args = node.create_args(instance_id, workspace_id=workspace_id)
    assert await node.command("instance.create", args) == {"accepted": True}
    frame = await node.wait_state(instance_id, RUNNING, FAILED)
    assert frame["state"] == RUNNING, frame
    return frame


async def stop_units(base: Path) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(DEADLINE):
        await stop_all_units(node_config(base))


@asynccontextmanager
async def left_node(build: BuildIdentity, *, stop_instance: bool = False
                    ) -> AsyncIterator[Node]:
    """A node as `build` that started inst-1 (ws-1) and then stopped: its VMM runs on,
    or, with `stop_instance`, inst-1 was stopped first (its objects detached, confirmed
    on disk).  At the end the units left are stopped and the root is removed."""
    base = short_dir()
    try:
        async with node_at(base, build) as node:
            await start(node, "inst-1", "ws-1")
            if stop_instance:
                result = await node.command("instance.stop", {"instance_id": "inst-1",
                                                              "force": False})
                assert result["confirmed_on_disk"] is True
        yield node
    finally:
        await stop_units(base)
        shutil.rmtree(base, ignore_errors=True)


def snapshot(*roots: Path) -> dict[str, tuple[Any, ...]]:
    """Every path under `roots` with its type, mode, size, mtime and content digest."""
    out: dict[str, tuple[Any, ...]] = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                st = path.lstat()
                digest = ""
                if path.is_file() and not path.is_symlink():
                    try:
                        digest = hashlib.sha256(path.read_bytes()).hexdigest()
                    except OSError:
                        digest = "unreadable"
                out[str(path)] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out
