"""Builds the node's `VmInstanceManager` from ``node.toml`` and the plugin registries.

``[vmm] backend`` and ``[supervisor] backend`` name registered plugins; each may have an
options table per backend (``[vmm.qemu]``, ``[supervisor.direct]``), of which only the
chosen backend's is used.  A table named after no registered backend is refused (a
typo must not silently drop options).  The ``direct`` supervisor keeps its unit records
in ``<storage.root>/runtime/supervisor`` unless its table says otherwise, so several
nodes on one host (a dev cluster) never share them.

Building the manager is part of the node's start: the attachment records a crash left
in ``runtime/storage-pools/`` are settled against the Instance records here
(`kibotos.node.records.attachments.Attachments.reconcile`), before the pool monitor's first
check (which renames unattached SHA-256 names) and before adoption.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kibotos.config import NodeConfig
from kibotos.core.errors import InvalidArgument
from kibotos.core.logs import EventLogger
from kibotos.node.instances.lifecycle import Launcher, Settings
from kibotos.node.instances.manager import VmInstanceManager
from kibotos.node.instances.network_step import NetworkStep
from kibotos.node.network.names import node_scope
from kibotos.node.records.attachments import Attachments
from kibotos.node.runtime import installations
from kibotos.node.runtime.build_identity import BuildIdentity
from kibotos.node.runtime.build_identity import current as current_build
from kibotos.node.storage.objects import KINDS, PoolObjects
from kibotos.node.storage.pools.legacy_names import NamedPoolObjects
from kibotos.node.storage.template_cache import TemplateCache
from kibotos.node.storage.templates import NodeTemplates
from kibotos.node.storage.transfer import NodeTransfers
from kibotos.plugins import Registries, load_plugins

log = EventLogger()


def settings_from(config: NodeConfig) -> Settings:
    vmm = config.vmm
    return Settings(ready_timeout=vmm.ready_timeout, stop_timeout=vmm.stop_timeout,
                    force_sync_timeout=vmm.force_sync_timeout,
                    monitor_interval=vmm.monitor_interval)


def _check_tables(section: str, tables: dict[str, Any], registry: Any) -> None:
    for name in tables:
        if name not in registry:
            raise InvalidArgument(
                f"[{section}.{name}]: no {section} backend is named {name!r} "
                f"(available: {', '.join(registry.names()) or 'none'})")


def supervisor_options(config: NodeConfig) -> dict[str, Any]:
    options = dict(config.supervisor.options())
    if config.supervisor.backend == "direct" and "state_dir" not in options:
        options["state_dir"] = str(config.storage.root / "runtime" / "supervisor")
    return options


def network_step(config: NodeConfig, backend: Any) -> NetworkStep | None:
    """The Instances' network with ``[network]`` (None without): named by the node's
    scope (its socket directory, as its data-plane units are), the tap owned by the
    account the backend runs its VMM as (``tap_owner()``, optional: root otherwise),
    the host ends in ``[testing] network_host_netns`` when a test gives one."""
    if config.network is None:
        return None
    owner = getattr(backend, "tap_owner", None)
    uid, gid = owner() if callable(owner) else (None, None)
    return NetworkStep(config.network, scope=node_scope(config.node.socket_dir),
                       root=config.storage.root,
                       host_netns=config.testing.network_host_netns, tap_owner=(uid, gid))


def build_instance_manager(config: NodeConfig, *, memory_tight: Callable[[], bool],
                           credential: Callable[[], str | None] | None = None,
                           registries: Registries | None = None,
                           settings: Settings | None = None,
                           receipt_wait: float | None = None,
                           pool_unavailable: Callable[[str], str | None] | None = None,
                           build: BuildIdentity | None = None,
                           runtime_dir: Path | None = None,
                           ) -> VmInstanceManager:
    """The manager the node runs; a bad backend name or option fails here, at start.

    With `credential` (the node's, for ctrl's artifact store) missing blobs are fetched
    into the Template cache; without it only blobs already on the host are used.
    `pool_unavailable` (the node's pool monitor) says why a pool cannot be used now;
    objects in such a pool are refused before anything is written.

    The current runtime installation is pinned here (`kibotos.node.runtime.installations.pin`,
    from `runtime_dir`, default this build's): every launch records it.  `build` is
    this build (`kibotos.node.runtime.build_identity.current`) unless a test stands for
    another release."""
    regs = registries or load_plugins(config.plugins.disable)
    _check_tables("vmm", config.vmm.backend_tables(), regs.vmm)
    _check_tables("supervisor", config.supervisor.backend_tables(), regs.supervisor)
    backend = regs.vmm.get(config.vmm.backend)(config.vmm.options())
    supervisor = regs.supervisor.get(config.supervisor.backend)(supervisor_options(config))
    node_id = config.node.id
    pools: dict[tuple[str, str], PoolObjects] = {}
    for pool in config.storage.pool:
        for kind in KINDS:
            extra: dict[str, Any] = {} if receipt_wait is None else {
                "receipt_wait": receipt_wait}
            if pool_unavailable is not None:
                extra["unavailable"] = functools.partial(pool_unavailable, pool.id)
            pools[(pool.id, kind)] = NamedPoolObjects(pool.id, pool.path, kind, node_id,
                                                      **extra)
    root = config.storage.root
    cache = None
    if credential is not None:
        cache = TemplateCache(root / "template-cache", ctrl_url=config.node.ctrl_urls,
                              credential=credential, limit=config.storage.template_cache_limit,
                              verify=config.node.ctrl_tls())
    templates = NodeTemplates(cache, [root / "template-cache", *config.vmm.artifact_dirs])
    # Attachment records a crash left are settled against the Instance records before
    # the pool monitor (its SHA-256 rename at start) or adoption read them.
    attachments = Attachments(root)
    settled = attachments.reconcile()
    if settled.deleted or settled.written:
        log.info("attachment records reconciled", deleted=len(settled.deleted),
                 written=len(settled.written), kept=len(settled.kept))
    launcher = Launcher(node_id=node_id, backend=backend, supervisor=supervisor, pools=pools,
                        templates=templates, settings=settings or settings_from(config),
                        attachments=attachments)
    launcher.build = build or current_build()
    launcher.network = network_step(config, backend)
    pinned = installations.pin(root, launcher.build, runtime_dir=runtime_dir, backend=backend)
    launcher.installation = pinned.launch_fields()
    manager = VmInstanceManager(node_id=node_id, root=root, launcher=launcher,
                                shared_pools={p.id: p.shared for p in config.storage.pool},
                                memory_tight=memory_tight, settings=launcher.settings,
                                machine_logs_limit=config.storage.machine_logs_limit)
    if credential is not None:
        storage = manager.storage
        manager.transfers = NodeTransfers(
            node_id=node_id, pool=launcher.pool, ctrl_url=config.node.ctrl_urls,
            credential=credential, verify=config.node.ctrl_tls(),
            guard=lambda doing, key: storage._working(doing, key),
            held=lambda key: storage._kept(key, True))
    return manager
