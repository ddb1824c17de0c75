"""``kibotos gateway e2b serve``: the E2B gateway process.

It serves E2B's control API on ``listen`` and envd's API for every sandbox on
``sandbox_listen`` (hypercorn's trio worker, as ctrl), runs the reaper that ends
sandboxes whose lifetime is over, counts both listeners' requests (``GET /metrics`` on
``listen``: `kibotos.gateway.e2b.metrics`), and holds the processes started through envd's
``Start`` (they outlive the request that started them, as in envd).  The bound
addresses (``listen`` may use port 0) go to ``task_status`` and, atomically, to
``<state_dir>/listen-address`` and ``<state_dir>/sandbox-listen-address``, removed on a
clean exit.  SIGTERM and SIGINT stop it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import trio
from hypercorn.trio import serve as hypercorn_serve

from kibotos.gateway.common.resume import Resumer
from kibotos.gateway.common.serving import hypercorn_config, stop_on_signals, write_address
from kibotos.gateway.e2b.config import GatewayConfig
from kibotos.gateway.e2b.control_api import build_control_app
from kibotos.gateway.e2b.ctrl_client import CtrlClient
from kibotos.gateway.e2b.envd_api import build_envd_app
from kibotos.gateway.e2b.envd_watch import WatcherTable
from kibotos.gateway.e2b.metrics import ASGIApp, GatewayMetrics
from kibotos.gateway.e2b.processes import ProcessTable
from kibotos.gateway.e2b.sandboxes import AccessTokens, Records
from kibotos.gateway.e2b.service import SandboxService

log = logging.getLogger("kibotos.gateway.e2b")

LISTEN_FILE, SANDBOX_LISTEN_FILE = "listen-address", "sandbox-listen-address"


def _prepare(config: GatewayConfig) -> tuple[list[Path], Records, AccessTokens]:
    """The state directory, read: the address files (removed), records, token key."""
    state_dir = Path(config.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    files = [state_dir / LISTEN_FILE, state_dir / SANDBOX_LISTEN_FILE]
    for path in files:
        path.unlink(missing_ok=True)
    return files, Records(state_dir), AccessTokens(state_dir)


async def serve_e2b_gateway(config: GatewayConfig, *, handle_signals: bool = True,
                            task_status: trio.TaskStatus[tuple[str, str]]
                            = trio.TASK_STATUS_IGNORED) -> None:
    """Run until cancelled or signalled; ``task_status.started((api, sandbox))``, the
    two bound ``host:port`` addresses."""
    files, records, tokens = await trio.to_thread.run_sync(_prepare, config)
    ctrl = CtrlClient(config.ctrl.url, config.read_credential(), verify=config.ctrl.tls(),
                      dataplane_verify=config.ctrl.dataplane_tls())
    metrics = GatewayMetrics()
    try:
        async with trio.open_nursery() as nursery:
            if handle_signals:
                nursery.start_soon(stop_on_signals, nursery.cancel_scope)
            resumer = Resumer(ctrl, nursery,
                              on_outcome=lambda outcome: metrics.resumes.labels(outcome).inc())
            service = SandboxService(config, ctrl, records, tokens, resumer)
            processes, watchers = ProcessTable(nursery), WatcherTable(nursery)
            control = build_control_app(service)
            control.add_route("/metrics", metrics.endpoint, methods=["GET"])
            apps: list[tuple[ASGIApp, str]] = [
                (metrics.middleware(control, "control"), config.listen),
                (metrics.middleware(build_envd_app(service, processes, watchers), "envd"),
                 config.sandbox_listen)]
            addresses = []
            for app, listen in apps:
                binds: list[str] = await nursery.start(
                    lambda task_status, app=app, listen=listen: hypercorn_serve(
                        app, hypercorn_config(listen), task_status=task_status))
                addresses.append(binds[0].split("://", 1)[-1])
            for path, address in zip(files, addresses, strict=True):
                write_address(path, address)
            nursery.start_soon(service.reap_forever)
            log.info("gateway: E2B API on %s, sandboxes on %s, ctrl %s", addresses[0],
                     addresses[1], config.ctrl.url)
            task_status.started((addresses[0], addresses[1]))
    finally:
        for path in files:
            path.unlink(missing_ok=True)
        with trio.CancelScope(shield=True):
            await ctrl.aclose()
