"""``kibotos ctrl serve``: the ctrl role's lifetime, from opening the store to shutdown.

Start: create the state directory, open and migrate the store, join the replica set
(`kibotos.ctrl.replica`: on SQLite, mark every session dead, as they died with the
previous process; on PostgreSQL, register this replica), load plugins, build the live services once
(`build_services`: the shared `Runtime` and every service on it), load or issue the
API's certificate (`kibotos.ctrl.tls`), serve the API with hypercorn's trio worker
(HTTPS unless ``[tls] enabled = false``), and run reconciliation.  The bound address (``listen`` may
use port 0) goes to ``task_status`` and, atomically, to ``<state_dir>/listen-address``
so tests and ``kibotos dev cluster`` can find ctrl.  SIGTERM or SIGINT: tell every
node the session closes, stop accepting, finish in-flight requests, exit.
"""

from __future__ import annotations

import logging
import signal
import ssl
from functools import partial
from pathlib import Path

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from kibotos.config import CtrlConfig
from kibotos.core import atomicfile
from kibotos.core.credentials import SigningKey, key_path
from kibotos.core.errors import KibotosError
from kibotos.ctrl.api.app import build_app
from kibotos.ctrl.live.context import CtrlContext, utcnow
from kibotos.ctrl.live.node_feed import NodeFeed
from kibotos.ctrl.live.node_sessions import SessionHub
from kibotos.ctrl.live.object_ops import ObjectOps
from kibotos.ctrl.live.placement_loop import PlacementLoop
from kibotos.ctrl.live.reconcile import run_reconcile
from kibotos.ctrl.live.registry_sweep import RegistrySweep
from kibotos.ctrl.live.runtime import Runtime
from kibotos.ctrl.live.services import CtrlServices
from kibotos.ctrl.live.transfer_service import TransferService
from kibotos.ctrl.live.volume_service import VolumeService
from kibotos.ctrl.live.workspace_service import WorkspaceService
from kibotos.ctrl.live.workspace_tasks import WorkspaceTasks
from kibotos.ctrl.model import instances as inst_mod
from kibotos.ctrl.model.placement import CapacityIndex
from kibotos.ctrl.relay import CommandRelay
from kibotos.ctrl.replica import Membership
from kibotos.ctrl.store import migrate
from kibotos.ctrl.store.artifacts import ArtifactStore, artifact_root
from kibotos.ctrl.store.db import SERVING_IDLE_IN_TRANSACTION_TIMEOUT, Store, make_engine
from kibotos.ctrl.store.secret_box import SecretBox
from kibotos.ctrl.store.secret_box import key_path as secret_key_path
from kibotos.ctrl.tls import CtrlTls
from kibotos.plugins import load_plugins
from kibotos.protocol import CloseReason
from kibotos.tls.ca import ClusterCA

log = logging.getLogger("kibotos.ctrl")

LISTEN_ADDRESS_FILE = "listen-address"


def _prepare_state_dir(state_dir: Path, address_file: Path) -> None:
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    # A stale address from the previous run must never be read as this run's.
    address_file.unlink(missing_ok=True)


def build_context(config: CtrlConfig, store: Store) -> CtrlContext:
    """The context a running ctrl shares; tests build theirs the same way."""
    hub = SessionHub(store, config.ctrl, utcnow)
    # Created in the state directory at the first start; nodes get its public key in
    # every welcome (docs/dataplane.md).
    key = SigningKey.load_or_create(key_path(config.ctrl.state_dir))
    hub.session_signing_public_key = key.public_key
    # Seals Egress passwords at rest; made beside the signing key (docs/network.md).
    secrets = SecretBox.load_or_create(secret_key_path(config.ctrl.state_dir))
    # Made beside them too, also when the API itself is plain HTTP: data-plane
    # certificates chain to it (docs/enrollment.md, "TLS").
    ca = ClusterCA.load_or_create(config.ctrl.state_dir)
    return CtrlContext(config=config, store=store,
                       registries=load_plugins(config.plugins.disable), sessions=hub,
                       session_signing_key=key, secrets=secrets, cluster_ca=ca)


def build_services(ctx: CtrlContext) -> CtrlServices:
    """Every live service of a ctrl, built once on one `Runtime` and wired here: who
    tells whom (callbacks), what each sweep resumes and in which order, who follows the
    node sessions.  Tests build theirs the same way; `CtrlServices.run` starts them."""
    if not isinstance(ctx.sessions, SessionHub):
        raise TypeError("build_services needs ctx.sessions to be a "
                        "kibotos.ctrl.live.node_sessions.SessionHub")
    # A misspelt policy must stop ctrl at start, naming the key and the choices.
    name = ctx.config.ctrl.placement_policy
    try:
        policy_cls = ctx.registries.placement.get(name)
    except KibotosError as exc:
        raise type(exc)(f"ctrl.placement_policy: {exc.message}") from None
    runtime = Runtime(ctx, CapacityIndex(policy_cls({})))
    tasks = WorkspaceTasks(runtime)
    feed = NodeFeed(runtime, follow=tasks.follow)
    placement = PlacementLoop(runtime, created=feed.created, orphaned=tasks.orphaned)
    workspaces = WorkspaceService(runtime, tasks=tasks, feed=feed, placement=placement)
    volumes = VolumeService(runtime)
    objects = ObjectOps(runtime, volumes)
    artifacts = ArtifactStore(artifact_root(ctx.config))
    artifacts.prepare()
    transfers = TransferService(runtime, volumes, artifacts)
    # Each sweep resumes Workspace stops and deletes, then Volumes, then object
    # operations (a ctrl start, and every few seconds).
    runtime.add_sweeper(tasks.sweep)
    runtime.add_sweeper(volumes.sweep)
    runtime.add_sweeper(objects.sweep)
    ctx.sessions.observers.append(workspaces)
    ctx.isolate_releasers.append(inst_mod.release_for_isolate)
    return CtrlServices(ctx=ctx, runtime=runtime, workspaces=workspaces, feed=feed,
                        volumes=volumes, objects=objects, transfers=transfers,
                        artifacts=artifacts)


async def open_store(config: CtrlConfig) -> Store:
    """Open the configured database (by default a file in the state directory, created
    if missing) and migrate it to the newest schema.  On PostgreSQL its connections abort
    a transaction left idle too long (`SERVING_IDLE_IN_TRANSACTION_TIMEOUT`)."""
    if not config.ctrl.database_url:
        await trio.to_thread.run_sync(partial(
            Path(config.ctrl.state_dir).mkdir, parents=True, exist_ok=True, mode=0o700))
    engine = make_engine(config.database_url,
                         idle_in_transaction_timeout=SERVING_IDLE_IN_TRANSACTION_TIMEOUT)
    try:
        await trio.to_thread.run_sync(migrate.upgrade, engine)
    except BaseException:
        engine.dispose()
        raise
    return Store(engine)


def _guard_hypercorn_close() -> None:
    """hypercorn 0.18's trio ``TCPServer._close`` sends EOF outside the connection's send
    lock.  When ctrl closes a node's WebSocket and the node's close frame arrives at
    that moment, the reply's ``send_all`` meets the EOF in flight, raises
    ``trio.BusyResourceError``, and the error escapes the connection handler and ends
    the whole server.  Take the send lock for the EOF too (unless this task already
    holds it, as when a failed send closes the connection).  Idempotent."""
    from hypercorn.trio.tcp_server import TCPServer

    original = TCPServer._close
    if getattr(original, "_kibotos_guarded", False):
        return

    async def _close(self: TCPServer) -> None:
        if self.send_lock.statistics().owner is trio.lowlevel.current_task():
            await original(self)
        else:
            async with self.send_lock:
                await original(self)

    _close._kibotos_guarded = True  # type: ignore[attr-defined]
    TCPServer._close = _close  # type: ignore[method-assign]


class _TlsConfig(HypercornConfig):
    """hypercorn's settings with the SSL context given, not built from file names: the
    context is `CtrlTls`'s, into which a renewed certificate is loaded while serving."""

    ssl_context: ssl.SSLContext | None = None

    def create_ssl_context(self) -> ssl.SSLContext | None:
        return self.ssl_context

    @property
    def ssl_enabled(self) -> bool:
        return self.ssl_context is not None


def prepare_tls(config: CtrlConfig, ctx: CtrlContext) -> CtrlTls | None:
    """The API's certificate loaded (or issued) as ``[tls]`` says; None for plain
    HTTP.  Blocking (files, key generation): tests that serve the app call it too."""
    if not config.tls.enabled:
        return None
    assert ctx.cluster_ca is not None, "build_context makes the cluster CA"
    tls = CtrlTls(config, ctx.cluster_ca)
    tls.prepare()
    return tls


#: How long an idle keep-alive connection stays open.  Well above the clients' own
#: (httpx closes a connection idle for 5 s, hypercorn's default is 5 s too): with equal
#: timeouts a client could send a request on a connection just as the server closed
#: it, and get "Server disconnected without sending a response" for a request ctrl never
#: saw (seen in bench/placement.py's runs).  75 s, as nginx.
KEEP_ALIVE_TIMEOUT = 75.0


def hypercorn_config(listen: str, tls: CtrlTls | None = None) -> HypercornConfig:
    """hypercorn settings for the ctrl app (HTTPS with `tls`, else plain HTTP); also
    installs the `_guard_hypercorn_close` fix, so whoever serves the app with this
    configuration (tests too) gets it."""
    _guard_hypercorn_close()
    hc = _TlsConfig()
    hc.ssl_context = tls.server.context if tls is not None else None
    hc.bind = [listen]
    hc.accesslog = None
    hc.graceful_timeout = 5.0
    hc.keep_alive_timeout = KEEP_ALIVE_TIMEOUT
    # The control session has its own pings and timeout; hypercorn's would only add
    # a second, differently tuned liveness check.
    hc.websocket_ping_interval = None
    return hc


async def _signals(shutdown: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
        async for signum in received:
            log.info("ctrl: %s received, shutting down", signal.Signals(signum).name)
            shutdown.set()
            return


async def serve_ctrl(config: CtrlConfig, *, handle_signals: bool = True,
                     task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Run ctrl until cancelled or signalled; ``task_status.started(address)`` once the
    API listens (``address`` is ``host:port``)."""
    _guard_hypercorn_close()
    state_dir = Path(config.ctrl.state_dir)
    address_file = state_dir / LISTEN_ADDRESS_FILE
    await trio.to_thread.run_sync(_prepare_state_dir, state_dir, address_file)
    store = await open_store(config)
    try:
        ctx = build_context(config, store)
        assert isinstance(ctx.sessions, SessionHub)
        hub = ctx.sessions
        membership = Membership(store, hub, config.ctrl.session_timeout, config.ctrl.listen)
        await membership.start()
        tls = await trio.to_thread.run_sync(prepare_tls, config, ctx)
        services = build_services(ctx)
        services.runtime.holds_lease = membership.holds_lease
        services.runtime.foreign_creates = membership.shared
        relay = None
        if membership.shared:
            # Commands for nodes whose session another replica holds, and the node
            # changes other replicas commit (docs/replicas.md).
            relay = CommandRelay(store, hub, membership.replica_id,
                                 services.runtime.watch.publish, services.runtime.inflight)
            hub.remote = relay
        app = build_app(services)
        shutdown = trio.Event()

        async def shutdown_trigger() -> None:
            await shutdown.wait()
            await hub.close_all(CloseReason.CTRL_SHUTDOWN)

        async with trio.open_nursery() as nursery:
            if handle_signals:
                nursery.start_soon(_signals, shutdown)

            async def run_http(*, task_status: trio.TaskStatus[list[str]]) -> None:
                await hypercorn_serve(app, hypercorn_config(config.ctrl.listen, tls),  # type: ignore[arg-type]
                                      shutdown_trigger=shutdown_trigger,
                                      task_status=task_status)
                nursery.cancel_scope.cancel()

            binds: list[str] = await nursery.start(run_http)
            address = binds[0].split("://", 1)[-1]
            atomicfile.write_bytes(address_file, (address + "\n").encode())
            log.info("ctrl: listening on %s, store %s", address,
                     store.engine.url.render_as_string(hide_password=True))
            if tls is not None:
                await nursery.start(tls.run)
            await nursery.start(membership.run)
            if relay is not None:
                await nursery.start(relay.run)
            await nursery.start(run_reconcile, hub, config.ctrl.reconcile_interval)
            await nursery.start(RegistrySweep(
                ctx, config.ctrl.reconcile_interval,
                live_nodes=lambda: [s.node_id for s in hub.live()]).run)
            await nursery.start(services.run)
            task_status.started(address)
    finally:
        address_file.unlink(missing_ok=True)
        store.close()
