"""A node's Instance manager with the ``direct`` supervisor and the ``testvmm`` backend,
for the lifecycle tests: short paths (agent sockets are unix sockets, at most 107
bytes), a local artifact directory with a Template's blobs, and waiting on the states
the manager publishes.  Every unit is stopped at the end, whatever the test did."""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

TESTPLUGINS = Path(__file__).resolve().parent.parent / "testplugins"
if str(TESTPLUGINS) not in sys.path:
    sys.path.insert(0, str(TESTPLUGINS))

from kibotos.config import NodeConfig, parse  # noqa: E402
from kibotos.node.instances.lifecycle import Settings  # noqa: E402
from kibotos.node.instances.manager import VmInstanceManager  # noqa: E402
from kibotos.node.instances.setup import build_instance_manager  # noqa: E402
from kibotos.node.storage.holder_watch import HolderWatch  # noqa: E402
from kibotos.node.storage.pools.dirs import prepare_pool_dirs  # noqa: E402
from kibotos.node.storage.pools.marker import init_pool  # noqa: E402
from kibotos.plugins import Registries, load_plugins  # noqa: E402

DEADLINE = 120
FAST = Settings(ready_timeout=60, stop_timeout=10, force_sync_timeout=5, monitor_interval=0.1)


def short_dir(prefix: str = "kn-") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def write_blob(artifacts: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    target = artifacts / "sha256" / digest
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return f"sha256:{digest}"


def write_template(base: Path) -> dict[str, str]:
    """A Template's three blobs in ``<base>/artifacts`` (the config's artifact_dirs)."""
    artifacts = base / "artifacts"
    return {"name": "tiny",
            "image_digest": write_blob(artifacts, b"template image\n"),
            "kernel_digest": write_blob(artifacts, b"kernel\n"),
            "initramfs_digest": write_blob(artifacts, b"initramfs\n")}


def registries() -> Registries:
    return load_plugins(test_modules=["kibotos_testvmm"])


@dataclass
class Node:
    base: Path
    config: NodeConfig
    manager: VmInstanceManager
    template: dict[str, str]
    tight: list[bool] = field(default_factory=lambda: [False])
    frames: list[dict[str, Any]] = field(default_factory=list)

    @property
    def root(self) -> Path:
        return self.config.storage.root

    @property
    def pool(self) -> Path:
        return self.config.storage.pool[0].path

    def create_args(self, instance_id: str = "inst-1", *, workspace_id: str = "ws-1",
                    ref: str | None = None, epoch: int = 1, create: bool = True,
                    **extra: Any) -> dict[str, Any]:
        args: dict[str, Any] = {
            "instance_id": instance_id, "workspace_id": workspace_id,
            "template": dict(self.template), "cpu_millis": 1500, "memory_bytes": 256 << 20,
            "layer": {"pool_id": "pool-a", "ref": ref or workspace_id,
                      "capacity_bytes": 64 << 20, "epoch": epoch, "create": create},
            "volumes": [], "launch": {"hostname": "box-1", "env": {"GREETING": "hi"}},
        }
        args.update(extra)
        return args

    async def command(self, kind: str, args: dict[str, Any]) -> dict[str, Any]:
        return await self.manager.command_handlers()[kind](args)

    def holder_check(self) -> HolderWatch:
        """A holder check over this node's Instances, wired as the manager wires its
        own, for a test to run one pass of by hand (`HolderWatch.check`); the manager's
        own one runs every 5 s beside it."""
        m = self.manager
        return HolderWatch(m.launcher, instances=m.instances, fail=m.fail, interval=3600)

    async def wait_state(self, instance_id: str, *states: str) -> dict[str, Any]:
        """The first published frame of `instance_id` in one of `states` (also one
        published before the call)."""
        feed = self.manager.state_feed()
        seen = 0
        with trio.fail_after(DEADLINE):
            while True:
                seen, frames = await feed.after(seen)
                for frame in frames:
                    if frame["instance_id"] == instance_id and frame["state"] in states:
                        return frame


def node_config(base: Path, *, backend_options: str = "", shared: bool = False,
                node_id: str = "node-a", pool: Path | None = None,
                ctrl_url: str = "http://127.0.0.1:9", extra: str = "",
                backend: str = "testvmm", node_extra: str = "",
                ctrl_ca_file: Path | None = None) -> NodeConfig:
    """`extra` is appended (further tables), `node_extra` goes into ``[node]``."""
    import tomllib

    pool = pool or base / "pool"
    # what an operator and the node's start do: marker, then the pool layout
    init_pool("pool-a", pool, adopt=True)
    prepare_pool_dirs("pool-a", pool)
    text = f"""
[node]
id = "{node_id}"
ctrl_url = "{ctrl_url}"
{f'ctrl_ca_file = "{ctrl_ca_file}"' if ctrl_ca_file else ""}
{node_extra}
[storage]
root = "{base / 'root'}"
[[storage.pool]]
id = "pool-a"
path = "{pool}"
default = true
shared = {str(shared).lower()}
[resources]
cpu = 4
memory = "8G"
[vmm]
backend = "{backend}"
artifact_dirs = ["{base / 'artifacts'}"]
[vmm.{backend}]
{backend_options}
{extra}"""
    return parse(NodeConfig, tomllib.loads(text), "test node.toml")


async def stop_all_units(config: NodeConfig) -> None:
    regs = registries()
    from kibotos.node.instances.setup import supervisor_options

    sup = regs.supervisor.get("direct")(supervisor_options(config))
    for info in await sup.list(""):
        await sup.stop(info.name, timeout=1)


@asynccontextmanager
async def running_node(*, backend_options: str = "", settings: Settings = FAST,
                       shared: bool = False, base: Path | None = None,
                       receipt_wait: float = 1.0, node_id: str = "node-a",
                       pool: Path | None = None, cleanup: bool = True,
                       ctrl_url: str = "http://127.0.0.1:9",
                       credential: str | None = None,
                       ctrl_ca_file: Path | None = None) -> AsyncIterator[Node]:
    """A running manager on a fresh root under /tmp (or `base`, to restart one)."""
    own = base is None
    base = base or short_dir()
    try:
        config = node_config(base, backend_options=backend_options, shared=shared,
                             node_id=node_id, pool=pool, ctrl_url=ctrl_url,
                             ctrl_ca_file=ctrl_ca_file)
        for sub in ("runtime", "template-cache", "machine-logs"):
            (config.storage.root / sub).mkdir(parents=True, exist_ok=True)
        template = write_template(base)
        tight = [False]
        manager = build_instance_manager(
            config, memory_tight=lambda: tight[0], registries=registries(),
            settings=settings, receipt_wait=receipt_wait,
            credential=(lambda: credential) if credential else None)
        node = Node(base, config, manager, template, tight)
        async with trio.open_nursery() as nursery:
            await nursery.start(manager.run)
            yield node
            nursery.cancel_scope.cancel()
    finally:
        if cleanup:
            with trio.CancelScope(shield=True):
                await stop_all_units(config)
            if own:
                shutil.rmtree(base, ignore_errors=True)
