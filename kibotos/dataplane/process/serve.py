"""`serve_dataplane`: one data-plane process, from binding its sockets to its drain.

It listens on the node's ``dataplane_listen`` address for WebSocket connections (exec,
`exec_session`, and port forwarding, `ports_session`) and plain HTTP requests (files,
`files_api`) and on
``<socket_dir>/dataplane/control.sock`` for the node.  It starts with no state: until
the node hands one over, every connection is refused with 503.  Afterwards it keeps
serving with the last state it got, also while the node is stopped (spec:
node-and-vmm-processes, "Data-plane processes").

Each connection is authenticated on its request (the upgrade, for WebSocket), before
anything reaches a guest: ``Authorization: Bearer <session credential>``, verified with
the public key the node handed over, for this node and for the operation of the path.  Refusals are
plain HTTP answers with the API's JSON error body: 401 for a credential that does not
verify or has expired, 403 for one of another node or operation, 404 for an Instance
this data plane does not serve (stopped, or moved), 503 without state or when the guest
cannot be reached.

The listener speaks TLS with the certificate the node supplies over the control socket
(`kibotos.dataplane.process.tls_listener`); plain HTTP only when asked for, on loopback.

SIGTERM or SIGINT: stop accepting (the listening socket closes), give the open
connections `drain_timeout` seconds (10 by default) to end on their own, close the rest
with 1001 and log how many were closed.

Generations (`listen_handover`): started with `DataplaneSettings.take_over_from`, the
process takes the listening socket and the state from that generation instead of
binding; asked to ``drain`` on its generation socket, it stops accepting and exits
when its last connection ends (a signal meanwhile starts the 10 s drain above).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from trio_websocket import ConnectionClosed, WebSocketRequest

from kibotos.core import failpoints
from kibotos.core.credentials import SessionClaims
from kibotos.core.errors import (
    InvalidArgument,
    KibotosError,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kibotos.core.logs import EventLogger
from kibotos.dataplane.clients.exec_wire import EXEC_PATH
from kibotos.dataplane.endpoints.exec_session import ExecSession
from kibotos.dataplane.endpoints.files_api import FilesRequest, route
from kibotos.dataplane.endpoints.http1 import HttpExchange, error_status
from kibotos.dataplane.endpoints.ports_session import (
    PORTS_PREFIX,
    PortSession,
    open_guest_port,
    parse_port_target,
)
from kibotos.dataplane.process import control
from kibotos.dataplane.process.build import build_id
from kibotos.dataplane.process.counted_listener import CountedListener
from kibotos.dataplane.process.guests import GuestPool
from kibotos.dataplane.process.listen_handover import (
    AFTER_CONTROL,
    HandoverPoint,
    generation_path,
    take_listeners,
)
from kibotos.dataplane.process.metrics import DataplaneMetrics
from kibotos.dataplane.process.state import DataplaneState, parse_state
from kibotos.dataplane.process.tls_listener import PLAIN_STATUS, DataplaneTls, check_plain
from kibotos.guest import GuestChannel
from kibotos.guest.ports import GuestPort

log = EventLogger("kibotos.dataplane")

DRAIN_TIMEOUT = 10.0
#: How much a WebSocket connection reads from its socket at a time: with trio-websocket's
#: default of 4 KiB a port-forward upload cost the data plane 3x the CPU (9.5 against
#: 2.9 ms per MiB) and ran at less than half the rate.
RECEIVE_BUFFER = 256 * 1024


@dataclass(frozen=True)
class DataplaneSettings:
    """The command line of ``kibotos dataplane serve``."""

    listen: str
    socket_dir: Path
    generation: int
    #: The generation whose listening socket and state this one takes over.
    take_over_from: int | None = None
    drain_timeout: float = DRAIN_TIMEOUT
    handle_signals: bool = True
    #: False: plain HTTP (``--plain``), refused off loopback.
    tls: bool = True


def split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(f"listen address must be host:port, got {listen!r}")
    return host.strip("[]"), int(port)


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise Unauthenticated("unsupported authorization: expected 'Bearer "
                                      "<session credential>'")
            return token.strip()
    raise Unauthenticated("missing session credential: send 'Authorization: Bearer "
                          "<credential>' (ask ctrl: POST /v1/workspaces/{id}/sessions)")


class _Connections:
    """The open exec sessions, so a stop can wait for them and then close the rest."""

    def __init__(self) -> None:
        self.sessions: dict[int, tuple[ExecSession | PortSession | None,
                                       trio.CancelScope]] = {}
        self._idle = trio.Event()
        self._idle.set()
        self._next = 0

    def add(self, scope: trio.CancelScope) -> int:
        self._next += 1
        self.sessions[self._next] = (None, scope)
        self._idle = trio.Event()
        return self._next

    def attach(self, key: int, session: ExecSession | PortSession) -> None:
        self.sessions[key] = (session, self.sessions[key][1])

    def remove(self, key: int) -> None:
        self.sessions.pop(key, None)
        if not self.sessions:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def close_all(self, grace: float = 3.0) -> int:
        """End every open session (close frame 1001); returns how many there were."""
        count = len(self.sessions)
        for session, _ in list(self.sessions.values()):
            if session is not None:
                session.shut_down()
        with trio.move_on_after(grace):
            await self.wait_idle()
        for _, scope in list(self.sessions.values()):
            scope.cancel()
        return count


class DataplaneServer:
    """The state, the guest channels, the counters and the open connections."""

    def __init__(self, settings: DataplaneSettings) -> None:
        self.settings = settings
        self.state: DataplaneState | None = None
        self.metrics = DataplaneMetrics()
        self.guests = GuestPool()
        self.connections = _Connections()
        self.handover = HandoverPoint(settings.generation, self.on_control)
        self.listen_address = settings.listen
        self.draining = False
        self._versions = 0
        self.tls = DataplaneTls(control.dataplane_dir(settings.socket_dir)) \
            if settings.tls else None

    # ---------------------------------------------------------------- control

    async def on_control(self, message: dict[str, Any]) -> dict[str, Any]:
        kind = message["type"]
        if kind == "state":
            state = parse_state(message, generation=self.settings.generation,
                                version=self._versions + 1)
            self._versions += 1
            self.state = state
            self.guests.retain_only(set(state.targets))
            self.metrics.state_updates.inc()
            log.info("state taken", generation=state.generation, version=state.version,
                     targets=len(state.targets))
            return {"generation": state.generation, "version": state.version,
                    "targets": len(state.targets)}
        if kind == "certificate":
            if self.tls is None:
                raise InvalidArgument("this data plane serves plain HTTP: it takes no "
                                      "certificate")
            answer = self.tls.load(message)
            log.info("certificate taken", serial=answer["certificate_serial"],
                     not_after=answer["certificate_not_after"])
            return answer
        if kind == "status":
            return {"generation": self.settings.generation, "build": build_id(),
                    "listen": self.listen_address, "configured_listen": self.settings.listen,
                    "pid": os.getpid(), "has_state": self.state is not None, "handover": True,
                    "version": self.state.version if self.state else 0,
                    "connections": len(self.connections.sessions),
                    "draining": self.draining,
                    **(self.tls.status() if self.tls else PLAIN_STATUS)}
        if kind == "metrics":
            return {"text": self.metrics.text()}
        raise InvalidArgument(f"unknown control request type {kind!r}")

    # ---------------------------------------------------------------- connections

    def authorize(self, headers: list[tuple[bytes, bytes]], operation: str
                  ) -> tuple[SessionClaims, Any]:
        state = self.state
        if state is None:
            raise Unavailable("this data plane has not been given its state by the node yet")
        claims = state.verifier.verify(bearer_token(headers), node_id=state.node_id,
                                       operation=operation)
        target = state.targets.get(claims.instance_id)
        if target is None:
            raise NotFound(f"Instance {claims.instance_id} of Workspace {claims.workspace_id} "
                           "is not served by this data plane (stopped, or on another node?)")
        if target.workspace_id is not None and target.workspace_id != claims.workspace_id:
            raise PermissionDenied(f"Instance {claims.instance_id} does not belong to "
                                   f"Workspace {claims.workspace_id}")
        return claims, target

    async def handle(self, request: WebSocketRequest) -> None:
        """One connection; never raises (an exception would end the whole server)."""
        try:
            await self._handle(request)
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client left during the handshake or the refusal: nothing to do
        except Exception as exc:
            log.error("connection handler failed", error=repr(exc))
            logging.getLogger("kibotos.dataplane").debug("traceback", exc_info=True)

    async def _handle(self, request: WebSocketRequest) -> None:
        path, _, query = request.path.partition("?")
        guest_port = None
        try:
            if path == EXEC_PATH:
                operation, port_target = "exec", None
            elif path.startswith(PORTS_PREFIX):
                operation, port_target = "ports", parse_port_target(path, query)
            else:
                raise NotFound(f"no such data-plane endpoint: {path}")
            claims, target = self.authorize(list(request.headers), operation)
            channel = await self.guests.channel(claims.instance_id, target.agent_socket,
                                                target.vsock_port)
            if port_target is not None:
                guest_port = await self._open_port(channel, *port_target)
        except KibotosError as exc:
            self.metrics.rejected.labels(exc.code).inc()
            log.info("connection refused", path=path, code=exc.code, error=exc.message,
                     remote=str(request.remote))
            body = json.dumps(exc.to_wire()).encode()
            await request.reject(error_status(exc), body=body, extra_headers=[
                (b"Content-Type", b"application/json")])
            return
        with trio.CancelScope() as scope:
            key = self.connections.add(scope)
            try:
                ws = await request.accept()
                self.metrics.connections.labels(operation).inc()
                self.metrics.active.inc()
                try:
                    session: ExecSession | PortSession = (
                        ExecSession(ws, channel, claims, self.metrics) if guest_port is None
                        else PortSession(ws, guest_port, claims, self.metrics))
                    self.connections.attach(key, session)
                    await session.run()
                finally:
                    self.metrics.active.dec()
            finally:
                self.connections.remove(key)
                if guest_port is not None:
                    await guest_port.aclose()  # (a no-op after the session's own end)

    async def _open_port(self, channel: GuestChannel, port: int, host: str | None
                         ) -> GuestPort:
        try:
            return await open_guest_port(channel, port, host)
        except KibotosError as exc:
            reason = exc.details.get("reason")
            self.metrics.ports_connect_failed.labels(
                reason if reason in ("connection_refused", "timeout") else "failed").inc()
            raise

    async def handle_http(self, exchange: HttpExchange) -> None:
        """One plain HTTP request (the file endpoints); never raises."""
        try:
            await self._handle_http(exchange)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client left: its transfer was cancelled in the guest on the way out
        except Exception as exc:
            log.error("HTTP handler failed", error=repr(exc))
            logging.getLogger("kibotos.dataplane").debug("traceback", exc_info=True)

    async def _handle_http(self, exchange: HttpExchange) -> None:
        try:
            name = route(exchange)
            claims, target = self.authorize(exchange.raw_headers, "files")
            channel = await self.guests.channel(claims.instance_id, target.agent_socket,
                                                target.vsock_port)
        except KibotosError as exc:
            self.metrics.rejected.labels(exc.code).inc()
            log.info("request refused", path=exchange.path, code=exc.code, error=exc.message,
                     remote=exchange.remote)
            await exchange.respond_error(exc)
            return
        with trio.CancelScope() as scope:
            key = self.connections.add(scope)
            self.metrics.connections.labels("files").inc()
            self.metrics.active.inc()
            try:
                await FilesRequest(exchange, channel, claims, self.metrics).run(name)
            finally:
                self.metrics.active.dec()
                self.connections.remove(key)

    # ---------------------------------------------------------------- the process

    async def serve(self, *, task_status: trio.TaskStatus[DataplaneServer]
                    = trio.TASK_STATUS_IGNORED) -> None:
        host, port = split_listen(self.settings.listen)
        if self.tls is None:
            check_plain(host)
        listeners = await self._listeners(host, port)
        self.handover.listening = [listener.socket for listener in listeners]
        sockname = listeners[0].socket.getsockname()
        self.listen_address = f"{host}:{sockname[1]}" if ":" not in host else \
            f"[{host}]:{sockname[1]}"
        control_path = control.control_path(self.settings.socket_dir)
        stop = trio.Event()
        async with trio.open_nursery() as handlers:
            await handlers.start(self.guests.run)
            await handlers.start(self.handover.serve, generation_path(
                self.settings.socket_dir, self.settings.generation))
            if self.settings.handle_signals:
                handlers.start_soon(self._signals, stop)
            async with trio.open_nursery() as accepting:
                server = CountedListener(self.handle, self.handle_http,
                                         self.tls.wrap(listeners) if self.tls else listeners,
                                         handler_nursery=handlers, disconnect_timeout=5.0,
                                         receive_buffer_size=RECEIVE_BUFFER)
                await accepting.start(server.run)
                await handlers.start(control.serve_control, control_path,
                                     self.handover.recording)
                failpoints.hit(AFTER_CONTROL)
                log.info("data plane serving", generation=self.settings.generation,
                         listen=self.listen_address, tls=self.tls is not None,
                         control=control_path, pid=os.getpid(),
                         build=build_id())
                task_status.started(self)
                await _first_of(stop.wait, self.handover.drain_requested.wait)
                self.draining = True
                accepting.cancel_scope.cancel()  # this copy of the listening socket closes
            if not stop.is_set():  # a newer generation serves: wait for the last one
                log.info("data plane stopped accepting", generation=self.settings.generation,
                         connections=server.open_streams)
                await _first_of(stop.wait, server.wait_no_streams)
            await self._drain()
            handlers.cancel_scope.cancel()

    async def _listeners(self, host: str, port: int) -> list[trio.SocketListener]:
        """Bound here, or taken over from an older generation with its state."""
        source = self.settings.take_over_from
        if source is None:
            try:
                return await trio.open_tcp_listeners(port, host=host)
            except OSError as exc:
                raise Unavailable(f"cannot listen on {self.settings.listen}: "
                                  f"{exc.strerror}") from None
        inherited = await take_listeners(generation_path(self.settings.socket_dir, source),
                                         host=host, port=port)
        await self.handover.replay(inherited)
        log.info("listening socket taken over", generation=self.settings.generation,
                 from_generation=inherited.from_generation, sockets=len(inherited.sockets),
                 replayed=",".join(m["type"] for m in inherited.replay) or "nothing")
        return [trio.SocketListener(trio.socket.from_stdlib_socket(sock))
                for sock in inherited.sockets]

    async def _signals(self, stop: trio.Event) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            async for signum in received:
                log.info("data plane stopping", signal=signal.Signals(signum).name,
                         connections=len(self.connections.sessions),
                         drain_timeout=f"{self.settings.drain_timeout:g}s")
                stop.set()
                return

    async def _drain(self) -> None:
        open_at_start = len(self.connections.sessions)
        with trio.move_on_after(self.settings.drain_timeout):
            await self.connections.wait_idle()
        closed = await self.connections.close_all()
        self.metrics.closed_on_stop.inc(closed)
        log.info("data plane stopped", generation=self.settings.generation,
                 open_at_stop=open_at_start, ended_on_their_own=open_at_start - closed,
                 closed=closed)


async def _first_of(*waits: Callable[[], Awaitable[object]]) -> None:
    """Until the first of `waits` returns."""
    async with trio.open_nursery() as nursery:
        async def one(wait: Callable[[], Awaitable[object]]) -> None:
            await wait()
            nursery.cancel_scope.cancel()

        for wait in waits:
            nursery.start_soon(one, wait)


async def serve_dataplane(settings: DataplaneSettings, *,
                          task_status: trio.TaskStatus[DataplaneServer]
                          = trio.TASK_STATUS_IGNORED) -> None:
    """Run one data-plane process until a signal ends it (or the caller cancels)."""
    server = DataplaneServer(settings)
    await server.serve(task_status=task_status)
