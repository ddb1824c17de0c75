"""Ending the VMM units a dev-cluster node started.

In production, VMM units outlive the node on purpose (a node restart or upgrade adopts
them).  A dev cluster is different: ``down`` promises to stop everything it started, and
the VMMs of its nodes are part of that.  The node is already stopped when this runs, so
the units are found and stopped through the node's own supervisor plugin, the same way
the node would (by the ``kibotos-vmm-`` prefix of their names).
"""

from __future__ import annotations

from pathlib import Path

import trio

from kibotos import config
from kibotos.node.instances.setup import supervisor_options
from kibotos.plugins import load_plugins

VMM_UNIT_PREFIX = "kibotos-vmm-"


async def _stop_vmm_units(cfg: config.NodeConfig, timeout: float) -> list[str]:
    regs = load_plugins(cfg.plugins.disable)
    supervisor = regs.supervisor.get(cfg.supervisor.backend)(supervisor_options(cfg))
    stopped = []
    for info in await supervisor.list(VMM_UNIT_PREFIX):
        await supervisor.stop(info.name, timeout=timeout)
        stopped.append(info.name)
    return stopped


def stop_vmm_units(node_config: Path, timeout: float = 10.0) -> list[str]:
    """Stop every VMM unit of the node whose configuration is `node_config`; return the
    unit names.  A node whose configuration is gone has nothing left to find."""
    if not node_config.exists():
        return []
    cfg = config.load(config.NodeConfig, node_config)
    return trio.run(_stop_vmm_units, cfg, timeout)
