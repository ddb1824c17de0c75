"""`serve_node`: the node role from start to cancellation.

Startup order matters, and each step fails with a message naming what was wrong:

0. under systemd, the startup checks of `kibotos.node.checks.startup_checks`: this process is
   its unit's MainPID, runs in the unit's cgroup, and no leftover helper of a previous
   node run is in it;
1. storage root and its subdirectories (nothing else can be written without them);
2. the owner lock, so a second node process on the same root stops before it writes;
3. the pools (`kibotos.node.storage.pools.startup.prepare`): their fixed subdirectories with the
   spec's owners and modes (a missing pool directory stops the start: absent means not
   mounted), then leftover temporary files under the storage root;
4. a new incarnation, persisted before anyone hears of it;
5. the identity, enrolling once if there is none;
6. the Instance manager (VMM backend and supervisor from the config; it reloads the
   Instances a previous process left);
7. with ``dataplane`` (always for ``kibotos node serve``): the data-plane process,
   adopted or started and given its state before ctrl hears from the node
   (`kibotos.node.dataplane.targets`); with ``[network]``: the egress processes
   (`kibotos.node.egress.wiring`), given the Instances the network records name and
   adopted or started before ctrl can send a policy naming an Egress or a Resolver
   (they run only while one does; without this wiring such a policy is refused);
8. then the pool availability monitor (marker and driver, now and every 30 s; its
   facts go to ctrl in hello and every report, a change triggers a report), the
   host-usage sampler, the manager's background work, the ``/metrics`` listener when
   ``metrics_listen`` is set (`kibotos.node.metrics`) and the control session, with the
   manager's command handlers, until cancelled.  The data-plane process is
   not stopped when the node stops: it keeps serving (spec).

systemd learns ``READY=1`` after the first session is established, so `systemctl start`
returns once ctrl sees the node.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import trio

from kibotos.config import NodeConfig
from kibotos.core.logs import EventLogger
from kibotos.node.checks.startup_checks import check_startup
from kibotos.node.dataplane.targets import DataplaneTargets
from kibotos.node.egress.wiring import NodeEgress
from kibotos.node.host import layout
from kibotos.node.host.clock import NodeClock
from kibotos.node.host.incarnation import next_incarnation
from kibotos.node.host.usage import SAMPLE_INTERVAL, UsageSampler
from kibotos.node.instances.contract import InstanceManager
from kibotos.node.instances.manager import VmInstanceManager
from kibotos.node.instances.setup import build_instance_manager
from kibotos.node.metrics import NodeMetrics, NodeParts, serve_metrics
from kibotos.node.runtime.build_identity import BuildIdentity
from kibotos.node.session.control import DEFAULT_TIMING, ControlSession, SessionTiming
from kibotos.node.session.identity import NodeIdentity, ensure_identity
from kibotos.node.session.report import ReportBoard
from kibotos.node.storage.pools import startup as pools_startup
from kibotos.node.storage.pools.availability import REFRESH as POOL_REFRESH
from kibotos.node.storage.pools.availability import PoolMonitor
from kibotos.plugins import load_plugins

log = EventLogger()


@dataclass
class NodeRuntime:
    """The running node's parts, handed to `task_status.started` for tests and tools."""

    config: NodeConfig
    paths: layout.NodePaths
    incarnation: int
    identity: NodeIdentity
    instances: InstanceManager
    sampler: UsageSampler
    board: ReportBoard
    session: ControlSession
    dataplane: DataplaneTargets | None = None
    pools: PoolMonitor | None = None
    egress: NodeEgress | None = None
    #: ``host:port`` of ``/metrics`` when ``[node] metrics_listen`` is set
    metrics_address: str | None = None


def notify_ready() -> None:
    """``READY=1`` to systemd when it asked for it (``NOTIFY_SOCKET``); cysystemd's
    notify raises without the variable, and a failed notify must not stop the node."""
    if not os.environ.get("NOTIFY_SOCKET"):
        return
    from cysystemd.daemon import Notification, notify

    try:
        notify(Notification.READY, return_exceptions=False)
    except Exception as exc:
        log.warning("sd_notify READY=1 failed", error=str(exc))


async def serve_node(
    config: NodeConfig,
    *,
    instances: InstanceManager | None = None,
    dataplane: bool = False,
    sample_interval: float = SAMPLE_INTERVAL,
    pool_interval: float = POOL_REFRESH,
    timing: SessionTiming = DEFAULT_TIMING,
    build: BuildIdentity | None = None,
    task_status: trio.TaskStatus[NodeRuntime] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the node until cancelled.  Raises `NodeIsolated` (exit status 75) when ctrl
    says this incarnation was isolated, after every Instance was destroyed.

    `dataplane` runs the data-plane process too.  ``kibotos node serve`` always does;
    tests that embed the node usually do not, because its unit outlives the node and
    would have to be stopped after the test.  `build` stands for another release in
    tests (`kibotos.node.runtime.build_identity`): its installation, its upgrade rules and the
    release in hello; production never passes it."""
    unit = await trio.to_thread.run_sync(check_startup)  # before any state is touched
    paths = layout.NodePaths(config.storage.root)
    layout.prepare_root(paths)
    with layout.OwnerLock(paths.lock_file):
        await trio.to_thread.run_sync(pools_startup.prepare, config)
        incarnation = next_incarnation(paths.incarnation_file)
        log.info("node starting", node_id=config.node.id, incarnation=incarnation,
                 root=paths.root, unit=unit.unit if unit else None)
        identity = await ensure_identity(config, paths.identity_file)

        def memory_tight_now() -> bool:
            """A fresh reading for an admission: ctrl may not know yet that memory
            turned tight, and the node must refuse then (ctrl tries another node)."""
            _, flipped = sampler.sample()
            if flipped:
                board.mark_changed()
            return sampler.tightness.tight

        registries = load_plugins(config.plugins.disable)
        # A pool change must reach ctrl at once; the board exists only after the
        # manager, so the callback looks it up when it fires.
        pools = pools_startup.monitor(config, registries.storage_driver,
                                      on_change=lambda: board.mark_changed())
        manager: InstanceManager = instances or build_instance_manager(
            config, memory_tight=memory_tight_now, credential=lambda: identity.credential,
            registries=registries, pool_unavailable=pools.unavailable_reason, build=build)
        sampler = UsageSampler(config.host.proc_root, manager)
        board = ReportBoard(manager, sampler.tightness)
        manager.set_change_callback(board.mark_changed)
        ready_sent = False

        def on_established() -> None:
            nonlocal ready_sent
            if not ready_sent:
                ready_sent = True
                notify_ready()

        targets = DataplaneTargets.for_node(
            config, manager, credential=lambda: identity.credential) if dataplane else None
        egress = _egress(config, manager, lambda: identity.credential)
        session = ControlSession(
            config, identity, incarnation,
            clock=NodeClock(config.testing.clock_skew_file),
            sampler=sampler, board=board,
            instances=targets.view() if targets else manager,
            on_established=on_established, timing=timing,
            on_welcome=targets.on_welcome if targets else None,
            pools=pools.facts,
            release=build.reported_release() if build else None,
            ssl_context=config.node.ctrl_tls(),
        )
        session.commands.update(manager.command_handlers())
        runtime = NodeRuntime(config, paths, incarnation, identity, manager, sampler, board,
                              session, targets, pools, egress)
        try:
            async with trio.open_nursery() as nursery:
                # the first check is done before the manager or ctrl asks
                await nursery.start(functools.partial(pools.run, interval=pool_interval))
                await nursery.start(functools.partial(
                    sampler.run, board.mark_changed, interval=sample_interval))
                await nursery.start(manager.run)
                if targets is not None:  # after the manager reloaded its Instances
                    await nursery.start(targets.run)
                if egress is not None:  # after the manager settled the network records
                    await nursery.start(egress.run)
                if config.node.metrics_listen:  # docs/metrics.md
                    metrics = NodeMetrics(NodeParts(
                        manager, sampler, session.status, pools.facts,
                        targets.dataplane if targets is not None else None,
                        targets.certificates.not_after_timestamp
                        if targets is not None and targets.certificates else None))
                    runtime.metrics_address = await nursery.start(functools.partial(
                        serve_metrics, metrics, config.node.metrics_listen, paths.runtime))
                task_status.started(runtime)
                await session.run()
        except BaseExceptionGroup as group:
            sole = _sole_exception(group)
            if sole is None:
                raise
            raise sole from None


def _egress(config: NodeConfig, manager: InstanceManager,
            credential: Callable[[], str | None]) -> NodeEgress | None:
    """The egress processes of a node with ``[network]``, handed to its Instances'
    network step (None: an Instance manager given by a test, or no network)."""
    if not isinstance(manager, VmInstanceManager) or manager.launcher.network is None:
        return None
    step = manager.launcher.network
    python = config.testing.egress_python
    egress = NodeEgress.for_node(config, step, credential=credential,
                                 python=None if python is None else str(python),
                                 environment=config.testing.egress_environment)
    step.egress = egress
    return egress


def _sole_exception(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception inside nested single-member groups (trio wraps the nursery body's
    exception even when it is alone), or None when there really were several."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) != 1:
            return None
        exc = exc.exceptions[0]
    return exc
