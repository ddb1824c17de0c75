"""Plain HTTP/1.1 beside WebSocket on the data-plane listener: one request per
connection, bodies streamed both ways, trailers for what is known only at the end.

The listener (`DataplaneListener`) reads each connection's request head first: an
``Upgrade: websocket`` request is handed to trio-websocket exactly as it arrived (the
head is replayed), anything else becomes an `HttpExchange` on h11.  h11 is the HTTP
engine httpx and hypercorn already bring; it streams both ways and supports chunked
trailers, which carry a download's sha256 (and, for a client that says ``TE:
trailers``, an error that happened after the 200 was sent).

Every exchange ends its connection (``Connection: close``): a refusal can be answered
before the upload's body was read, and no body ever has to be drained for a next
request.  After answering such a request early the server half-closes and reads what
the client still sends for a few seconds (a "lingering close"), so the client reads
the answer instead of a reset.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import trio
from trio_websocket import WebSocketRequest, WebSocketServer

from kibotos.core.errors import InvalidArgument, KibotosError
from kibotos.core.logs import EventLogger
from kibotos.dataplane.clients.until_none import UntilNone

log = EventLogger("kibotos.dataplane")

#: A request head larger than this is refused (h11's own default bound).
MAX_HEAD = 16 * 1024
#: How long a client has to send its request head.
HEAD_TIMEOUT = 30.0
#: After an early answer: how long, and how much, the server still reads and drops.
LINGER_SECONDS, LINGER_BYTES = 5.0, 64 << 20
RECEIVE_CHUNK = 256 * 1024
_HTTP_STATUS_REASON = {502: b"Bad Gateway", 507: b"Insufficient Storage"}


class ReplayStream(trio.abc.Stream):
    """`stream` with `prefix` put back in front of what it receives."""

    def __init__(self, prefix: bytes, stream: trio.abc.Stream) -> None:
        self._prefix = prefix
        self._stream = stream

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._prefix:
            size = len(self._prefix) if max_bytes is None else max_bytes
            data, self._prefix = self._prefix[:size], self._prefix[size:]
            await trio.lowlevel.checkpoint()
            return data
        return bytes(await self._stream.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()


async def read_head(stream: trio.abc.Stream) -> bytes:
    """The bytes up to and including the end of the request head (and whatever of the
    body came with them); b"" if the client left or sent too much."""
    data = bytearray()
    with trio.move_on_after(HEAD_TIMEOUT):
        while b"\r\n\r\n" not in data and len(data) <= MAX_HEAD:
            chunk = await stream.receive_some(RECEIVE_CHUNK)
            if not chunk:
                return b""
            data += chunk
        return bytes(data)
    return b""


def wants_websocket(head: bytes) -> bool:
    for line in head.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"upgrade" and b"websocket" in value.lower():
            return True
    return False


class HttpExchange:
    """One HTTP request and its answer."""

    def __init__(self, stream: trio.abc.Stream, conn: h11.Connection,
                 request: h11.Request) -> None:
        self.stream = stream
        self.conn = conn
        self.method = request.method.decode("ascii")
        target = request.target.decode("ascii", "replace")
        self.path, _, query = target.partition("?")
        self.raw_headers = list(request.headers)
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                        for k, v in request.headers}
        self.trailers: dict[str, str] = {}
        self.remote = ""
        self._query = query
        self._body_done = False
        self.responded = False

    @classmethod
    async def start(cls, stream: trio.abc.Stream, head: bytes) -> HttpExchange | None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        conn.receive_data(head)
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            await stream.send_all(_plain_error(400, f"bad HTTP request: {exc}"))
            return None
        if not isinstance(event, h11.Request):
            await stream.send_all(_plain_error(400, "bad HTTP request"))
            return None
        return cls(stream, conn, event)

    def query(self) -> dict[str, str]:
        """The query parameters; a repeated one is refused (no guessing which counts)."""
        try:
            pairs = urllib.parse.parse_qsl(self._query, keep_blank_values=True,
                                           strict_parsing=bool(self._query))
        except ValueError:
            raise InvalidArgument("the query string is malformed") from None
        found: dict[str, str] = {}
        for key, value in pairs:
            if key in found:
                raise InvalidArgument(f"query parameter {key!r} is given twice")
            found[key] = value
        return found

    # -- the request body

    def body(self) -> UntilNone[bytes]:
        """The request body as it arrives; afterwards `trailers` holds its trailers.
        (An iterator object, not an async generator: leaving the loop early needs no
        cleanup.)"""
        return UntilNone(self._next_body_chunk)

    async def _next_body_chunk(self) -> bytes | None:
        if self._body_done:
            return None
        if self.conn.they_are_waiting_for_100_continue:
            await self._send(h11.InformationalResponse(status_code=100, headers=[]))
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = await self.stream.receive_some(RECEIVE_CHUNK)
                self.conn.receive_data(bytes(data))
                if not data and self.conn.their_state is h11.SEND_BODY:
                    raise InvalidArgument("the client closed the connection before the "
                                          "end of the request body")
                continue
            if isinstance(event, h11.Data):
                return bytes(event.data)
            if isinstance(event, h11.EndOfMessage):
                self.trailers = {k.decode("latin-1").lower(): v.decode("latin-1")
                                 for k, v in event.headers}
                self._body_done = True
                return None
            raise InvalidArgument(f"unexpected {type(event).__name__} in the request")

    async def read_body(self, limit: int) -> bytes:
        data = bytearray()
        async for chunk in self.body():
            data += chunk
            if len(data) > limit:
                raise InvalidArgument(f"the request body is larger than {limit} bytes")
        return bytes(data)

    # -- the answer

    async def _send(self, event: Any) -> None:
        data = self.conn.send(event)
        if data:
            await self.stream.send_all(data)

    async def respond(self, status: int, body: bytes, content_type: str,
                      headers: list[tuple[str, str]] | None = None) -> None:
        self.responded = True
        await self._send(h11.Response(status_code=status, reason=_reason(status), headers=[
            ("Content-Type", content_type), ("Content-Length", str(len(body))),
            ("Connection", "close"), *(headers or [])]))
        await self._send(h11.Data(data=body))
        await self._send(h11.EndOfMessage())

    async def respond_json(self, status: int, body: dict[str, Any]) -> None:
        await self.respond(status, json.dumps(body, separators=(",", ":")).encode(),
                           "application/json")

    async def respond_error(self, exc: KibotosError) -> None:
        await self.respond_json(error_status(exc), exc.to_wire())

    async def start_stream(self, status: int, content_type: str,
                           headers: list[tuple[str, str]]) -> None:
        """A chunked answer whose body follows with `send`, ended by `end`."""
        self.responded = True
        await self._send(h11.Response(status_code=status, reason=_reason(status), headers=[
            ("Content-Type", content_type), ("Transfer-Encoding", "chunked"),
            ("Connection", "close"), *headers]))

    async def send(self, data: bytes | bytearray) -> None:
        await self._send(h11.Data(data=bytes(data)))

    async def end(self, trailers: list[tuple[str, str]]) -> None:
        await self._send(h11.EndOfMessage(headers=trailers))

    async def wait_client_closed(self) -> None:
        """Until the client closes the connection (or it breaks): how an answer that
        has no end of its own learns that nobody reads it.  Only for a request whose
        body was read (or that has none): anything more the client sends is dropped."""
        try:
            while await self.stream.receive_some(RECEIVE_CHUNK):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return

    @property
    def trailers_ok(self) -> bool:
        return "trailers" in self.headers.get("te", "").lower()

    async def finish(self) -> None:
        """Close the connection; if the request body was not read, linger first."""
        try:
            if self.responded and not self._body_done and self.conn.their_state in (
                    h11.SEND_BODY, h11.IDLE, h11.SEND_RESPONSE):
                await self._linger()
        finally:
            await trio.aclose_forcefully(self.stream)

    async def _linger(self) -> None:
        send_eof = getattr(self.stream, "send_eof", None)
        if send_eof is None:
            return
        try:
            await send_eof()
            dropped = 0
            with trio.move_on_after(LINGER_SECONDS):
                while dropped < LINGER_BYTES:
                    data = await self.stream.receive_some(RECEIVE_CHUNK)
                    if not data:
                        return
                    dropped += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return


def error_status(exc: KibotosError) -> int:
    """The HTTP status of an error: the API's, except 507 for a full disk in the
    guest (what HTTP has for it, and what E2B's envd answers) and 502 for a guest port
    nothing listens on (what a proxy answers: a gateway can pass it on as it is)."""
    if exc.details.get("reason") == "no_space":
        return 507
    if exc.details.get("reason") == "connection_refused":
        return 502
    return exc.http_status


def _reason(status: int) -> bytes:
    return _HTTP_STATUS_REASON.get(status, b"")


def _plain_error(status: int, message: str) -> bytes:
    body = json.dumps({"error": {"code": "invalid_argument", "message": message}}).encode()
    return (f"HTTP/1.1 {status} Bad Request\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


HttpHandler = Callable[[HttpExchange], Awaitable[None]]


class DataplaneListener(WebSocketServer):
    """trio-websocket's server, with plain HTTP requests taken aside.

    It overrides the server's per-connection method (`_handle_connection`, the one
    place that sees the raw stream, in trio-websocket 0.11 and 0.12): WebSocket
    upgrades go on as before; the exec tests and the files tests cover both paths.
    """

    def __init__(self, ws_handler: Callable[[WebSocketRequest], Awaitable[None]],
                 http_handler: HttpHandler, listeners: Any, **kwargs: Any) -> None:
        super().__init__(ws_handler, listeners, **kwargs)
        self._http_handler = http_handler

    async def _handle_connection(self, stream: trio.abc.Stream) -> None:
        try:
            head = await read_head(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            head = b""  # a failed TLS handshake (a client that refused our certificate)
        if not head:
            await trio.aclose_forcefully(stream)
            return
        if wants_websocket(head):
            await super()._handle_connection(ReplayStream(head, stream))
            return
        try:
            exchange = await HttpExchange.start(stream, head)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            exchange = None
        if exchange is None:
            await trio.aclose_forcefully(stream)
            return
        sock = getattr(getattr(stream, "transport_stream", stream), "socket", None)
        if sock is not None:
            try:
                exchange.remote = str(sock.getpeername())
            except OSError:
                exchange.remote = ""
        try:
            await self._http_handler(exchange)
        finally:
            await exchange.finish()
