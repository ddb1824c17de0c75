"""The client end of exec: what ``kibo workspace exec`` (and tests, and later the E2B
gateway) use to run a process through a node's data plane.

::

    async with open_exec(url, credential, ExecRequest(("sh", "-c", "cat; exit 3"))) as ex:
        await ex.send_stdin(b"hi\\n")
        await ex.close_stdin()
        async for event in ex.events():
            if isinstance(event, Output):
                print(event.stream, event.data)
        print(ex.exit.returncode)          # 3

trio-websocket is the WebSocket library, as for the node's control session (httpx has
no WebSocket support).  The client owns its TCP stream, so the socket is closed on every
way out, also when the server closes first.  A refused upgrade becomes the
`KibotosError` the data plane's JSON body names; an ``error`` frame after the upgrade
is raised from `events`; a connection that ends without an ``exit`` frame is
`Unavailable`.
"""

from __future__ import annotations

import ssl
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
    wrap_client_stream,
)

from kibotos.core.errors import DeadlineExceeded, InvalidArgument, KibotosError, Unavailable
from kibotos.dataplane.clients import exec_wire
from kibotos.dataplane.clients.exec_wire import (
    MAX_MESSAGE,
    STDIN_CHUNK,
    ExecRequest,
    Exited,
    Output,
    Started,
    exec_url,
)
from kibotos.dataplane.clients.tls_client import connect_dataplane
from kibotos.dataplane.clients.until_none import UntilNone
from kibotos.dataplane.process.groups import sole_error
from kibotos.guest import ExitStatus

__all__ = ["STDIN_CHUNK", "Event", "ExecClient", "Output", "Started", "exec_url", "open_exec",
           "open_websocket", "ws_url"]

#: How much is read from the socket at a time (trio-websocket's 4 KiB default cost the
#: data plane's peers three times the CPU per MiB; docs/dataplane.md).
RECEIVE_BUFFER = 256 * 1024

Event = Started | Output | ExitStatus


def _rejection(exc: ConnectionRejected, url: str) -> KibotosError:
    return exec_wire.rejection(exc.status_code, exc.body, url)


class ExecClient:
    """One running exec; created by `open_exec`."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self._ws = ws
        self.pid: int | None = None
        self.exit: ExitStatus | None = None

    async def send_stdin(self, data: bytes) -> None:
        for frame in exec_wire.stdin_frames(data):
            await self._send(frame)

    async def close_stdin(self) -> None:
        await self._send(exec_wire.eof_frame())

    async def resize(self, rows: int, cols: int) -> None:
        await self._send(exec_wire.resize_frame(rows, cols))

    async def signal(self, sig: str | int, *, group: bool = True) -> None:
        await self._send(exec_wire.signal_frame(sig, group))

    def events(self) -> UntilNone[Event]:
        """Started, then Output until the streams end, then the ExitStatus (also kept
        in `exit`); raises the data plane's error, or `Unavailable` if the connection
        ends without an exit.  (An iterator object, not an async generator, so leaving
        the loop early needs no cleanup.)"""
        return UntilNone(self.next_event)

    async def next_event(self) -> Event | None:
        """The next event, or None once the exit was delivered."""
        while self.exit is None:
            try:
                message = await self._ws.get_message()
            except ConnectionClosed as exc:
                reason = exc.reason
                detail = f" ({reason.code} {reason.reason or ''}".rstrip() + ")" \
                    if reason is not None else ""
                raise Unavailable("the data-plane connection closed before the process "
                                  "exited" + detail) from None
            decoded = exec_wire.decode(message)
            if isinstance(decoded, Exited):
                self.exit = ExitStatus.from_wire(decoded.as_wire())
                return self.exit
            if isinstance(decoded, Started):
                self.pid = decoded.pid or None
            if decoded is not None:  # None: a control message of a newer data plane
                return decoded
        return None

    async def _send(self, data: bytes | str) -> None:
        try:
            await self._ws.send_message(data)
        except ConnectionClosed:
            raise Unavailable("the data-plane connection is closed") from None


@asynccontextmanager
async def open_exec(dataplane_url: str, credential: str | None, request: ExecRequest, *,
                    connect_timeout: float = 30.0,
                    ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[ExecClient]:
    """Connect, authenticate, send the request; the process runs inside the block.
    (`credential` None sends no Authorization header: the data plane answers 401.)"""
    async with open_websocket(exec_url(dataplane_url), credential,
                              connect_timeout=connect_timeout,
                              ssl_context=ssl_context) as ws:
        client = ExecClient(ws)
        await client._send(exec_wire.request_frame(request))
        yield client


def ws_url(dataplane_url: str, path: str, query: str = "") -> str:
    """``http://host:port`` (what ctrl returns) → ``ws://host:port<path>?<query>``."""
    parts = urllib.parse.urlsplit(dataplane_url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.hostname:
        raise InvalidArgument(f"data-plane URL {dataplane_url!r} must be http(s)://host:port")
    return str(urllib.parse.urlunsplit(
        (scheme, parts.netloc, parts.path.rstrip("/") + path, query, "")))


@asynccontextmanager
async def open_websocket(url: str, credential: str | None, *, connect_timeout: float = 30.0,
                         ssl_context: ssl.SSLContext | None = None
                         ) -> AsyncIterator[WebSocketConnection]:
    """A WebSocket to the data plane at `url` (``ws://`` or ``wss://``) with the
    credential as bearer, closed on every way out.  A refused upgrade is the
    `KibotosError` its JSON body names."""
    headers = [] if credential is None else [
        (b"Authorization", f"Bearer {credential}".encode())]
    target = urllib.parse.urlsplit(url)
    host = target.hostname or ""
    tls = target.scheme == "wss"
    port = target.port or (443 if tls else 80)
    resource = target.path + (f"?{target.query}" if target.query else "")
    stream = await connect_dataplane(host, port, tls=tls, context=ssl_context, url=url,
                                     timeout=connect_timeout)
    try:
        async with trio.open_nursery() as nursery:
            try:
                with trio.fail_after(connect_timeout):
                    ws = await wrap_client_stream(
                        nursery, stream, target.netloc, resource,
                        extra_headers=headers, max_message_size=MAX_MESSAGE,
                        receive_buffer_size=RECEIVE_BUFFER)
            except ConnectionRejected as exc:
                raise _rejection(exc, url) from None
            except HandshakeError as exc:
                raise Unavailable(f"WebSocket handshake with {url} failed: {exc}") from None
            except trio.TooSlowError:
                raise DeadlineExceeded(f"the data plane at {url} did not answer the "
                                       f"upgrade within {connect_timeout:g}s") from None
            try:
                yield ws
            finally:
                with trio.move_on_after(2.0, shield=True):
                    await ws.aclose()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The upgrade's refusal is raised by the connection's reader task, so it
        # arrives in the nursery's group.
        leaf = sole_error(group)
        if isinstance(leaf, ConnectionRejected):
            raise _rejection(leaf, url) from None
        if isinstance(leaf, HandshakeError):
            raise Unavailable(f"WebSocket handshake with {url} failed: {leaf!r}") from None
        if leaf is None:
            raise
        raise leaf from None
    finally:
        await trio.aclose_forcefully(stream)
