"""What the node does with its pools at start, in order (called by `serve_node`).

1. `prepare`: the fixed subdirectories in every pool (a missing pool directory stops the
   start with the spec's message), then the temporary files of the node's own local
   directories;
2. `PoolMonitor`: the marker and driver check now and at least once a minute after;
   when a pool is first seen available, its leftovers go by the pool rules (all in a
   dedicated pool, only this node's in a shared one), then the unattached objects this
   node holds that still have the SHA-256 names of versions before v0.1.0 are renamed
   to their IDs (`kibotos.node.storage.pools.legacy_names`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kibotos.backends import HostPaths
from kibotos.config import NodeConfig, PoolSection
from kibotos.core.logs import EventLogger
from kibotos.node.storage.pools import legacy_names
from kibotos.node.storage.pools.availability import PoolMonitor
from kibotos.node.storage.pools.dirs import SUBDIRS, check_traversable, prepare_pool_dirs
from kibotos.node.storage.pools.tempfiles import Sweep, sweep_local, sweep_pool

log = EventLogger()


def prepare(config: NodeConfig) -> None:
    """Pool directories, then local leftovers (pool subtrees under storage.root are
    left to the pool rules).

    Each existing pool directory must be traversable by the VMM identity before the
    node creates anything in it (spec's troubleshooting table: the node fails to start);
    a pool at storage.root is the node's own directory and not checked here."""
    for pool in config.storage.pool:
        if pool.path.is_dir() and pool.path != config.storage.root:
            check_traversable(pool.id, pool.path)
        prepare_pool_dirs(pool.id, pool.path)
    skip: list[Path] = []
    for pool in config.storage.pool:
        skip.extend(pool.path / kind for kind in SUBDIRS)
        skip.append(pool.path)
    sweep = sweep_local(config.storage.root, skip=[p for p in skip
                                                   if p != config.storage.root])
    _log_sweep("local", sweep)


def _log_sweep(where: str, sweep: Sweep, *, shared: bool = False) -> None:
    if sweep.deleted or sweep.errors:
        log.info("node temporary files deleted", where=where, count=len(sweep.deleted),
                 errors="; ".join(sweep.errors) or None)
    if sweep.left:
        log.warning("node temporary files left", where=where, count=len(sweep.left),
                    shared=shared, examples=", ".join(str(p) for p in sweep.left[:3]),
                    hint="files without this node's ID in a shared pool: delete them "
                         "only after stopping every node that declares the pool")


def clean_pool(pool: PoolSection, node_id: str) -> Sweep:
    sweep = sweep_pool(pool.path, shared=pool.shared, node_id=node_id)
    _log_sweep(f"pool {pool.id}", sweep, shared=pool.shared)
    return sweep


def monitor(config: NodeConfig, registry: Any, *,
            on_change: Callable[[], None] | None = None) -> PoolMonitor:
    host = HostPaths(proc_root=config.host.proc_root, sys_root=config.host.sys_root)
    node_id = config.node.id

    def first_available(pool: PoolSection) -> None:
        clean_pool(pool, node_id)
        legacy_names.rename_at_start(pool, node_id, config.storage.root)

    return PoolMonitor(config.storage.pool, registry, host, on_change=on_change,
                       on_first_available=first_available)
