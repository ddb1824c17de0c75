"""The client end of port forwarding: one TCP connection to a port in a Workspace as a
trio `HalfCloseableStream`, through the node's data plane (``GET /v1/ports/{port}``,
`kibotos.dataplane.endpoints.ports_session`).  ``kibo workspace port-forward`` runs one per
accepted local connection; a gateway can do the same, or speak the documented
WebSocket protocol itself (docs/dataplane.md, "Ports").

::

    async with open_port(url, credential, 8080) as conn:
        await conn.send_all(b"GET / HTTP/1.0\\r\\n\\r\\n")
        await conn.send_eof()                 # the guest's server reads EOF
        async for chunk in conn: ...           # until the server shut down its side

Nothing listening in the guest is `Unavailable` (``details.reason:
connection_refused``) from `open_port`, before any byte moves.  A reset in the guest
after that is a `trio.BrokenResourceError` from `receive_some`/`send_all` whose
``__cause__`` is the data plane's error.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from kibotos.core.errors import InvalidArgument, KibotosError, Unavailable, error_from_wire
from kibotos.dataplane.clients.client import open_websocket, ws_url
from kibotos.dataplane.endpoints.ports_session import CLOSE_NORMAL, PORTS_PREFIX

#: Bytes are sent in messages of at most this size.
SEND_CHUNK = 256 * 1024
_EOF = json.dumps({"type": "eof"})


class PortConnection(trio.abc.HalfCloseableStream):
    """One forwarded connection; created by `open_port`."""

    def __init__(self, ws: WebSocketConnection, port: int) -> None:
        self._ws = ws
        self.port = port
        self._rest = b""
        self._eof = False
        self._sent_eof = False
        self._error: KibotosError | None = None

    @property
    def error(self) -> KibotosError | None:
        """Why the connection broke (a reset in the guest, the data plane gone)."""
        return self._error

    def _broken(self, error: KibotosError) -> trio.BrokenResourceError:
        self._error = self._error or error
        exc = trio.BrokenResourceError(self._error.message)
        exc.__cause__ = self._error
        return exc

    def _closed_error(self, exc: ConnectionClosed) -> KibotosError:
        reason = exc.reason
        detail = f" ({reason.code} {reason.reason or ''}".rstrip() + ")" if reason else ""
        return Unavailable(f"the data-plane connection for port {self.port} closed" + detail)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._error is not None:
            raise self._broken(self._error)
        while not self._rest:
            if self._eof:
                await trio.lowlevel.checkpoint()
                return b""
            try:
                message = await self._ws.get_message()
            except ConnectionClosed as exc:
                raise self._broken(self._closed_error(exc)) from None
            if isinstance(message, bytes):
                self._rest = message
                continue
            body = _parse(message)
            if body.get("type") == "eof":
                self._eof = True
            elif body.get("type") == "error":
                raise self._broken(error_from_wire({"error": body}))
            # Unknown control messages are from a newer data plane: ignored.
        size = len(self._rest) if max_bytes is None else max_bytes
        data, self._rest = self._rest[:size], self._rest[size:]
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._sent_eof:
            raise trio.ClosedResourceError("the sending side was shut down (send_eof)")
        if self._error is not None:
            raise self._broken(self._error)
        view = memoryview(data)
        try:
            while view:
                chunk, view = view[:SEND_CHUNK], view[SEND_CHUNK:]
                await self._ws.send_message(bytes(chunk))
        except ConnectionClosed as exc:
            raise self._broken(self._closed_error(exc)) from None
        await trio.lowlevel.checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        """Half-close: the guest's server reads EOF; reading goes on."""
        if self._sent_eof:
            await trio.lowlevel.checkpoint()
            return
        self._sent_eof = True
        try:
            await self._ws.send_message(_EOF)
        except ConnectionClosed as exc:
            raise self._broken(self._closed_error(exc)) from None

    async def finish(self) -> KibotosError | None:
        """After both EOFs: wait for the data plane's close; None when the guest closed
        cleanly, else the error it reported."""
        while self._error is None:
            try:
                message = await self._ws.get_message()
            except ConnectionClosed as exc:
                if exc.reason is not None and exc.reason.code == CLOSE_NORMAL:
                    return None
                return self._closed_error(exc)
            if isinstance(message, str) and _parse(message).get("type") == "error":
                self._error = error_from_wire({"error": _parse(message)})
        return self._error

    async def aclose(self) -> None:
        with trio.move_on_after(2.0, shield=True):
            await self._ws.aclose()


def _parse(message: str) -> dict[str, object]:
    try:
        body = json.loads(message)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise Unavailable(f"the data plane sent a bad control frame: {message[:80]!r}")
    return body


def ports_url(dataplane_url: str, port: int, host: str | None = None) -> str:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidArgument(f"port must be a number from 1 to 65535, not {port!r}")
    return ws_url(dataplane_url, f"{PORTS_PREFIX}{port}", f"host={host}" if host else "")


@asynccontextmanager
async def open_port(dataplane_url: str, credential: str | None, port: int, *,
                    host: str | None = None, connect_timeout: float = 30.0,
                    ssl_context: ssl.SSLContext | None = None
                    ) -> AsyncIterator[PortConnection]:
    """A connection to `port` on the Workspace's loopback (`host` ``127.0.0.1`` or
    ``::1``; None for either) for the block."""
    async with open_websocket(ports_url(dataplane_url, port, host), credential,
                              connect_timeout=connect_timeout,
                              ssl_context=ssl_context) as ws:
        yield PortConnection(ws, port)
