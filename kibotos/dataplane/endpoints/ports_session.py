"""One port-forward connection over one WebSocket: ``GET /v1/ports/{port}[?host=H]``.

The protocol (docs/dataplane.md, "Ports"), with a session credential that grants
``ports``:

* before the upgrade the data plane connects to the port on the guest's loopback
  (`host` ``127.0.0.1`` or ``::1``; unset: 127.0.0.1, then ::1), so a refusal is a plain
  HTTP answer with the API's JSON error body: **502** when nothing listens there
  (``details.reason: connection_refused``, and the port), 401/403/404/503 as for exec;
* after the upgrade **binary** frames carry the connection's bytes, both ways, as they
  are (no stream byte: one connection per WebSocket);
* a **text** frame ``{"type": "eof"}`` is a half-close, either way: from the client,
  the guest's server reads EOF (``shutdown(SHUT_WR)`` in the guest); from the server,
  the guest's server shut down its side.  The other direction goes on;
* once both directions ended and the guest closed its socket the server closes with
  1000; a reset or failure in the guest is ``{"type": "error", "code", "message",
  "details"}`` and a close with 1011; a client that closes first (or drops) closes the
  guest's connection too.

Back-pressure is end to end: a client frame is read only when the guest granted credit
for its bytes, and the guest's server is read only as fast as the WebSocket takes its
bytes, so one window per direction is all the data plane ever holds for a connection.
"""

from __future__ import annotations

import json
from typing import Any

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from kibotos.core.credentials import SessionClaims
from kibotos.core.errors import InvalidArgument, NotFound, Unavailable
from kibotos.core.logs import EventLogger
from kibotos.dataplane.endpoints.relay import Relay, control_message
from kibotos.dataplane.process.metrics import DataplaneMetrics
from kibotos.guest import GuestChannel
from kibotos.guest.ports import LOOPBACK_HOSTS, GuestPort

log = EventLogger("kibotos.dataplane")

PORTS_PREFIX = "/v1/ports/"
#: The guest credit per direction of one connection: enough in flight to keep both hops
#: busy, and the most the data plane holds for it.
PORT_WINDOW = 1024 * 1024
#: How long the guest may take to answer the connect (it gives up itself after 10 s).
OPEN_TIMEOUT = 20.0
#: After both directions ended: how long the guest may take to say it closed.
END_TIMEOUT = 10.0
CLOSE_NORMAL, CLOSE_GOING_AWAY, CLOSE_PROTOCOL, CLOSE_SERVER_ERROR = 1000, 1001, 1008, 1011
_MAX_TEXT = 4096


def parse_port_target(path: str, query: str) -> tuple[int, str | None]:
    """The guest port and host of ``/v1/ports/{port}?host=H``; NotFound for another
    path, InvalidArgument naming what is wrong."""
    import urllib.parse

    if not path.startswith(PORTS_PREFIX):
        raise NotFound(f"no such data-plane endpoint: {path}")
    raw = path[len(PORTS_PREFIX):]
    if not raw.isdigit() or raw.startswith("0") or not 1 <= int(raw) <= 65535:
        raise InvalidArgument(f"ports: the port in {path} must be a number from 1 to 65535")
    try:
        params = urllib.parse.parse_qs(query, keep_blank_values=True, strict_parsing=bool(
            query))
    except ValueError:
        raise InvalidArgument("ports: the query string is malformed") from None
    unknown = sorted(set(params) - {"host"})
    if unknown:
        raise InvalidArgument(f"ports: unknown parameters {unknown}")
    hosts = params.get("host", [])
    if len(hosts) > 1 or (hosts and hosts[0] not in LOOPBACK_HOSTS):
        raise InvalidArgument(f"ports: host must be one of {list(LOOPBACK_HOSTS)} (the "
                              "guest's loopback), given once")
    return int(raw), hosts[0] if hosts else None


async def open_guest_port(channel: GuestChannel, port: int, host: str | None) -> GuestPort:
    """The connection in the guest, or the guest's refusal (Unavailable with reason
    ``connection_refused`` when nothing listens)."""
    with trio.move_on_after(OPEN_TIMEOUT) as scope:
        return await channel.ports.open(port, host=host, window=PORT_WINDOW)
    assert scope.cancelled_caught
    raise Unavailable(f"the guest did not answer the connect to port {port} within "
                      f"{OPEN_TIMEOUT:g}s")


class PortSession(Relay):
    """Relays one connection; `run` returns when it is over, whichever way."""

    def __init__(self, ws: WebSocketConnection, port: GuestPort, claims: SessionClaims,
                 metrics: DataplaneMetrics) -> None:
        super().__init__(ws)
        self.port = port
        self.claims = claims
        self.metrics = metrics
        self._up_done = self._down_done = False

    async def run(self) -> None:
        log.info("port connection open", instance_id=self.claims.instance_id,
                 address=self.port.address, credential=self.claims.jti)
        with trio.CancelScope() as scope:
            self._scope = scope
            if self._outcome is None:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._up)
                    nursery.start_soon(self._down)
        await self._conclude()

    def shut_down(self) -> None:
        """The data plane is stopping: end this connection now (its drain is over)."""
        self._finish("stopping")

    # -------------------------------------------------------------- the two directions

    async def _up(self) -> None:
        """Client → guest, until the client's EOF; then only watching for its close."""
        counter = self.metrics.ports_bytes.labels("to_guest")
        while True:
            message = await self._client_message()
            if message is None:
                return
            try:
                if isinstance(message, bytes):
                    if self._up_done:
                        raise InvalidArgument("ports: a binary frame after the client's eof")
                    if message:
                        await self.port.send_all(message)
                        counter.inc(len(message))
                    continue
                if _control(message) != "eof" or self._up_done:
                    raise InvalidArgument("ports: the client's only control frame is one "
                                          '{"type": "eof"}')
                await self.port.send_eof()
                self._up_done = True
                self._maybe_done()
            except InvalidArgument as exc:
                self._finish("protocol", exc)
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self._guest_failed()
                return

    async def _down(self) -> None:
        """Guest → client, to the server's EOF."""
        counter = self.metrics.ports_bytes.labels("from_guest")
        try:
            while chunk := await self.port.receive_some():
                await self.ws.send_message(chunk)
                counter.inc(len(chunk))
            await self.ws.send_message('{"type":"eof"}')
        except ConnectionClosed:
            self._finish("client_gone")
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self._guest_failed()
            return
        self._down_done = True
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self._up_done and self._down_done:
            self._finish("ended")

    async def _guest_failed(self) -> None:
        error = await self.port.wait_ended() or Unavailable(
            f"the connection to {self.port.address} in the guest broke")
        self._finish("guest_failed", error)

    # -------------------------------------------------------------- the end

    async def _conclude(self) -> None:
        outcome = self._outcome or "client_gone"
        error = self._error
        if outcome == "ended":
            with trio.move_on_after(END_TIMEOUT):
                error = await self.port.wait_ended()
            outcome = "ended" if error is None and self.port.error is None else "guest_failed"
            error = error or self.port.error
        self.metrics.ports_closed.labels(outcome).inc()
        log.info("port connection closed", instance_id=self.claims.instance_id,
                 address=self.port.address, outcome=outcome,
                 sent=self.port.sent, received=self.port.received)
        if outcome != "ended":
            await self.port.aclose()  # closes it in the guest unless it ended there
        with trio.move_on_after(2.0, shield=True):
            try:
                if outcome == "ended":
                    await self.ws.aclose(CLOSE_NORMAL, "connection closed")
                elif outcome == "guest_failed":
                    failure = error or Unavailable("the guest's connection failed")
                    await self.ws.send_message(json.dumps(
                        {"type": "error", **failure.to_wire()["error"]}))
                    await self.ws.aclose(CLOSE_SERVER_ERROR, failure.message[:120])
                elif outcome == "protocol":
                    assert error is not None
                    await self.ws.send_message(json.dumps(
                        {"type": "error", **error.to_wire()["error"]}))
                    await self.ws.aclose(CLOSE_PROTOCOL, error.message[:120])
                elif outcome == "stopping":
                    await self.ws.aclose(CLOSE_GOING_AWAY, "data plane stopping")
                else:
                    await self.ws.aclose()
            except ConnectionClosed:
                return


def _control(text: str) -> Any:
    body = control_message(text, _MAX_TEXT, "ports")
    return body.get("type") if isinstance(body, dict) else None
