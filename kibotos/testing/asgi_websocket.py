"""ctrl's WebSocket endpoint in-process: an ASGI WebSocket server over an in-memory
stream, the WebSocket counterpart of ``httpx.ASGITransport``.

Why: a test of ctrl against simulated nodes (`kibotos.testing.fake_node`) that runs
without sockets has nothing outside trio's view, so it can run under a clock that jumps
(`kibotos.testing.clock`): a session timeout of 3 s or a ping every second then costs
no real time, and no test depends on how fast the machine is.  The node's side is the
real trio-websocket client, the ctrl side is the real ASGI app; only hypercorn's part
(HTTP/1.1 and WebSocket framing to ASGI events) is played here, by trio-websocket's
server half and `_AsgiWebSocket`.  ``tests/ctrl/test_ctrl_serve.py`` and the end-to-end
tests keep covering hypercorn itself.

    connect = InProcessConnector(build_app(build_services(ctx)), nursery)
    async with open_sim_node("http://ctrl", cred, "node-a", 1, connect=connect) as node:
        ...

What is played (the ASGI WebSocket spec, version 2.3): ``websocket.connect`` first, then
each message as ``websocket.receive`` and the peer's close (or a dropped stream) as
``websocket.disconnect``; ``websocket.accept`` (with a subprotocol and headers),
``websocket.send``, ``websocket.close`` (before ``accept``: an HTTP 403), and the
``websocket.http.response`` extension (the app's own denial response, status and body).
A send after the peer went away raises `OSError`, as the spec asks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio
import trio.testing
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest
from trio_websocket import wrap_server_stream as _wrap_server_stream

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: How long closing waits for the peer's close frame; it comes at once from a live peer.
CLOSE_TIMEOUT = 5.0


class PeerGone(OSError):
    """The app sent on a WebSocket whose peer has gone (ASGI: an `OSError`)."""


class _AsgiWebSocket:
    """One connection's ASGI ``receive`` and ``send``, over a trio-websocket request."""

    def __init__(self, request: WebSocketRequest) -> None:
        self.request = request
        self.ws: WebSocketConnection | None = None
        self.state = "connecting"  # -> accepted | responding -> closed
        self.connect_delivered = False
        self.close_code = 1006
        self.close_reason = ""
        self.response_status = 0
        self.response_headers: list[tuple[bytes, bytes]] = []
        self.response_body = b""

    async def receive(self) -> Message:
        if not self.connect_delivered:
            self.connect_delivered = True
            return {"type": "websocket.connect"}
        if self.state == "accepted":
            assert self.ws is not None
            try:
                data = await self.ws.get_message()
            except ConnectionClosed as exc:
                self._closed_by_peer(exc)
            else:
                if isinstance(data, str):
                    return {"type": "websocket.receive", "text": data}
                return {"type": "websocket.receive", "bytes": data}
        if self.state == "closed":
            return {"type": "websocket.disconnect", "code": self.close_code,
                    "reason": self.close_reason}
        raise RuntimeError(f"receive while the WebSocket is {self.state} (the app must "
                           "accept or deny first)")

    def _closed_by_peer(self, exc: ConnectionClosed) -> None:
        self.state = "closed"
        if exc.reason is not None:
            self.close_code = exc.reason.code
            self.close_reason = exc.reason.reason or ""

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "websocket.accept" and self.state == "connecting":
            headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
            self.ws = await self.request.accept(subprotocol=message.get("subprotocol"),
                                                extra_headers=headers)
            self.state = "accepted"
        elif kind == "websocket.send":
            await self._send_data(message)
        elif kind == "websocket.close":
            await self._close(int(message.get("code", 1000)), message.get("reason"))
        elif kind == "websocket.http.response.start" and self.state == "connecting":
            self.state = "responding"
            self.response_status = int(message["status"])
            self.response_headers = [(bytes(k), bytes(v))
                                     for k, v in message.get("headers", [])]
        elif kind == "websocket.http.response.body" and self.state == "responding":
            self.response_body += bytes(message.get("body", b""))
            if not message.get("more_body", False):
                self.state = "closed"
                await self._reject(self.response_status, self.response_headers,
                                   self.response_body)
        else:
            raise RuntimeError(f"ASGI message {kind!r} while the WebSocket is {self.state}")

    async def _send_data(self, message: Message) -> None:
        if self.state != "accepted":
            raise PeerGone(f"WebSocket is {self.state}")
        assert self.ws is not None
        text, data = message.get("text"), message.get("bytes")
        try:
            await self.ws.send_message(text if text is not None else bytes(data or b""))
        except ConnectionClosed as exc:
            self._closed_by_peer(exc)
            raise PeerGone("the peer closed the WebSocket") from None

    async def _close(self, code: int, reason: str | None) -> None:
        if self.state == "connecting":
            self.state = "closed"
            await self._reject(403, [], b"")
        elif self.state == "accepted":
            self.state = "closed"
            self.close_code, self.close_reason = code, reason or ""
            assert self.ws is not None
            with trio.move_on_after(CLOSE_TIMEOUT):
                await self.ws.aclose(code, reason or None)

    async def _reject(self, status: int, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> None:
        with contextlib.suppress(ConnectionClosed):  # the peer gave up first
            await self.request.reject(status, extra_headers=headers, body=body or None)

    async def finish(self) -> None:
        """After the app returned: what a server does with a connection it left open
        (an HTTP 500 before accept, a normal close after)."""
        if self.state in ("connecting", "responding"):
            self.state = "closed"
            await self._reject(500, [], b"")
        elif self.state == "accepted":
            await self._close(1000, None)


def websocket_scope(request: WebSocketRequest) -> Scope:
    """The ASGI scope of a WebSocket handshake, as a server on loopback makes it."""
    path, _, query = request.path.partition("?")
    return {
        "type": "websocket",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "scheme": "ws",
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 50000),
        "root_path": "",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": [(bytes(k).lower(), bytes(v)) for k, v in request.headers],
        "subprotocols": list(request.proposed_subprotocols),
        "extensions": {"websocket.http.response": {}},
    }


async def serve_asgi_websocket(app: ASGIApp, stream: trio.abc.Stream) -> None:
    """Serve one WebSocket connection of `app` on `stream` until the app returns.

    An exception of the app propagates (a test should see it, where hypercorn would
    log it); the stream is closed in any case."""
    try:
        async with trio.open_nursery() as nursery:
            request = await _wrap_server_stream(nursery, stream)
            conn = _AsgiWebSocket(request)
            try:
                await app(websocket_scope(request), conn.receive, conn.send)
            finally:
                with trio.CancelScope(shield=True):
                    await conn.finish()
            nursery.cancel_scope.cancel()
    except ConnectionClosed:
        pass  # the peer went away during the handshake
    finally:
        await trio.aclose_forcefully(stream)


class InProcessConnector:
    """Opens in-memory streams to `app`'s WebSocket endpoint: each call makes a
    `trio.testing.memory_stream_pair`, serves one end in `nursery` and returns the
    other, for ``open_sim_node(..., connect=connector)``."""

    def __init__(self, app: ASGIApp, nursery: trio.Nursery) -> None:
        self.app = app
        self.nursery = nursery
        self.connections = 0

    async def __call__(self) -> trio.abc.Stream:
        client, server = trio.testing.memory_stream_pair()
        self.connections += 1
        self.nursery.start_soon(serve_asgi_websocket, self.app, server,
                                name=f"asgi-websocket-{self.connections}")
        return client
