"""``kibotos gateway exposure serve``: the Exposure gateway process.

It accepts client connections on ``listen`` (over TLS with ``[tls]``; each a
`ClientConnection`, at most
``limits.max_connections`` at once: one more is answered 503 and closed) and serves
``GET /metrics`` on ``metrics_listen`` (hypercorn, as the E2B gateway).  The bound
addresses (port 0 allowed) go to ``task_status`` and, atomically, to
``<state_dir>/listen-address`` and ``<state_dir>/metrics-listen-address``, removed on a
clean exit.  SIGTERM and SIGINT stop it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import ssl
from pathlib import Path

import trio
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.routing import Route

from kibotos.gateway.common.ctrl_http import CtrlHttp
from kibotos.gateway.common.resume import Resumer
from kibotos.gateway.common.serving import hypercorn_config, stop_on_signals, write_address
from kibotos.gateway.exposure.access import SandboxAccess
from kibotos.gateway.exposure.config import ExposureConfig
from kibotos.gateway.exposure.metrics import ExposureMetrics
from kibotos.gateway.exposure.proxy import ClientConnection

log = logging.getLogger("kibotos.gateway.exposure")

LISTEN_FILE, METRICS_LISTEN_FILE = "listen-address", "metrics-listen-address"
_BUSY_TEXT = b"the gateway has too many connections\n"
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n"
         b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_BUSY_TEXT), _BUSY_TEXT))
#: How long a closing connection's unread input is drained (see `_close_gently`).
LINGER_S = 2.0


def _prepare(config: ExposureConfig) -> list[Path]:
    state_dir = Path(config.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    files = [state_dir / LISTEN_FILE, state_dir / METRICS_LISTEN_FILE]
    for path in files:
        path.unlink(missing_ok=True)
    return files


class _NoHandshake(Exception):
    """The client did not complete the TLS handshake (in time)."""


async def _handshake(raw: trio.SocketStream, context: ssl.SSLContext,
                     timeout: float) -> trio.SSLStream[trio.SocketStream]:
    stream = trio.SSLStream(raw, context, server_side=True, https_compatible=True)
    try:
        with trio.fail_after(timeout):
            await stream.do_handshake()
    except (trio.TooSlowError, trio.BrokenResourceError):
        raise _NoHandshake from None
    return stream


async def _close_gently(raw: trio.SocketStream) -> None:
    """Close after the client had the chance to read what was sent: closing a socket
    with unread input sends a reset, which can destroy an answer still in flight (a
    refusal sent before the request's body was read).  So: our side shut, the client's
    input drained until it closes, for at most `LINGER_S`."""
    try:
        with trio.move_on_after(LINGER_S), contextlib.suppress(
                trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await raw.send_eof()
            while await raw.receive_some(1 << 16):
                pass
    finally:  # also when the gateway is stopping (cancelled)
        await raw.aclose()


def _peer(raw: trio.SocketStream) -> str:
    try:
        return str(raw.socket.getpeername()[0])
    except OSError:
        return "unknown"


def _host_port(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


async def serve_exposure_gateway(config: ExposureConfig, *, handle_signals: bool = True,
                                 task_status: trio.TaskStatus[tuple[str, str]]
                                 = trio.TASK_STATUS_IGNORED) -> None:
    """Run until cancelled or signalled; ``task_status.started((proxy, metrics))``, the
    two bound ``host:port`` addresses."""
    files = await trio.to_thread.run_sync(_prepare, config)
    ctrl = CtrlHttp(config.ctrl.url, config.read_credential(),
                    user_agent="kibotos-gateway-exposure", command_prefix="gwexp",
                    verify=config.ctrl.tls(), dataplane_verify=config.ctrl.dataplane_tls())
    metrics = ExposureMetrics()
    tls = config.tls.context() if config.tls is not None else None
    open_connections = 0

    async def handle(raw: trio.SocketStream) -> None:
        nonlocal open_connections
        stream: trio.abc.Stream = raw
        if open_connections >= config.limits.max_connections:
            with trio.move_on_after(5), contextlib.suppress(trio.BrokenResourceError,
                                                            trio.ClosedResourceError):
                await raw.send_all(_BUSY)
            await _close_gently(raw)
            return
        open_connections += 1
        metrics.connections.inc()
        try:
            if tls is not None:
                stream = await _handshake(raw, tls, config.limits.header_timeout_s)
            await ClientConnection(stream, _peer(raw), access, metrics, config.limits,
                                   config.domain).run()
        except _NoHandshake:
            pass
        except Exception:  # one connection's bug must not end the others (serve_tcp would)
            log.exception("gateway: a client connection failed")
        finally:
            open_connections -= 1
            metrics.connections.dec()
            await (_close_gently(raw) if stream is raw else stream.aclose())

    try:
        async with trio.open_nursery() as nursery:
            if handle_signals:
                nursery.start_soon(stop_on_signals, nursery.cancel_scope)
            access = SandboxAccess(ctrl, Resumer(
                ctrl, nursery, on_outcome=lambda outcome: metrics.resumes.labels(outcome).inc()))
            host, port = _host_port(config.listen)
            listeners: list[trio.SocketListener] = await nursery.start(
                functools.partial(trio.serve_tcp, handle, port, host=host))
            bound = listeners[0].socket.getsockname()
            proxy_address = f"{bound[0]}:{bound[1]}"
            app = Starlette(routes=[Route("/metrics", metrics.endpoint, methods=["GET"])])
            binds: list[str] = await nursery.start(
                lambda task_status: hypercorn_serve(
                    app, hypercorn_config(config.metrics_listen),  # type: ignore[arg-type]
                    task_status=task_status))
            metrics_address = binds[0].split("://", 1)[-1]
            for path, address in zip(files, (proxy_address, metrics_address), strict=True):
                write_address(path, address)
            log.info("gateway: exposure proxy on %s, metrics on %s, ctrl %s", proxy_address,
                     metrics_address, config.ctrl.url)
            task_status.started((proxy_address, metrics_address))
    finally:
        for path in files:
            path.unlink(missing_ok=True)
        with trio.CancelScope(shield=True):
            await ctrl.aclose()
