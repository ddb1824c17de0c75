"""`kibotos.testing.asgi_websocket`: a Starlette app's WebSocket endpoint served over
in-memory streams, driven by the real trio-websocket client (what the simulated node
uses), with each ASGI path the ctrl session takes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
import trio
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    WebSocketConnection,
    wrap_client_stream,
)

from kibotos.testing.asgi_websocket import InProcessConnector
from kibotos.testing.clock import ThreadAwareClock

#: What the endpoints saw, for the test to check after the fact.
SEEN: list[object] = []


async def echo(ws: WebSocket) -> None:
    SEEN.append(("headers", ws.headers.get("authorization"), ws.url.path,
                 ws.query_params.get("q")))
    await ws.accept()
    try:
        while True:
            text = await ws.receive_text()
            if text == "close":
                await ws.close(4001, "asked to")
                return
            await ws.send_text(text.upper())
    except WebSocketDisconnect as exc:
        SEEN.append(("disconnect", exc.code))


async def deny(ws: WebSocket) -> None:
    await ws.send_denial_response(JSONResponse({"error": "nope"}, status_code=401))


async def refuse(ws: WebSocket) -> None:
    await ws.close(1008)


async def leave(ws: WebSocket) -> None:
    await ws.accept()


async def late_send(ws: WebSocket) -> None:
    await ws.accept()
    with pytest.raises(WebSocketDisconnect):
        await ws.receive_text()
    try:
        await ws.send_text("anyone?")
    except (WebSocketDisconnect, OSError) as exc:  # starlette maps the OSError
        SEEN.append(("late send refused", type(exc).__name__))


APP = Starlette(routes=[WebSocketRoute("/echo", echo), WebSocketRoute("/deny", deny),
                        WebSocketRoute("/refuse", refuse), WebSocketRoute("/leave", leave),
                        WebSocketRoute("/late", late_send)])


@asynccontextmanager
async def client(path: str, headers: list[tuple[bytes, bytes]] | None = None
                 ) -> AsyncIterator[WebSocketConnection]:
    """A trio-websocket client on a fresh in-memory connection to `APP`.  Leaving the
    block closes it and waits until the server side is done too, so `SEEN` is complete;
    a refused upgrade raises `ConnectionRejected` bare (it comes from a task)."""
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                stream = await InProcessConnector(APP, nursery)()
                ws = await wrap_client_stream(nursery, stream, "ctrl",  # type: ignore[arg-type]
                                              path, extra_headers=headers)
                try:
                    yield ws
                finally:
                    await ws.aclose()
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if len(leaves) == 1 and isinstance(leaves[0], ConnectionRejected):
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:  # type: ignore[type-arg]
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


@pytest.fixture(autouse=True)
def clear_seen() -> None:
    SEEN.clear()


async def test_messages_both_ways_and_the_scope(autojump_clock: ThreadAwareClock) -> None:
    async with client("/echo?q=1", [(b"Authorization", b"Bearer x")]) as ws:
        await ws.send_message("hello")
        assert await ws.get_message() == "HELLO"
    assert SEEN == [("headers", "Bearer x", "/echo", "1"), ("disconnect", 1000)]


async def test_the_apps_close_reaches_the_client(autojump_clock: ThreadAwareClock) -> None:
    async with client("/echo") as ws:
        await ws.send_message("close")
        with pytest.raises(ConnectionClosed) as info:
            await ws.get_message()
    assert info.value.reason.code == 4001
    assert info.value.reason.reason == "asked to"


async def test_a_denial_response_is_an_http_refusal(autojump_clock: ThreadAwareClock) -> None:
    with pytest.raises(ConnectionRejected) as info:
        async with client("/deny"):
            pass  # pragma: no cover
    assert info.value.status_code == 401
    assert json.loads(info.value.body or b"") == {"error": "nope"}


async def test_close_before_accept_is_403(autojump_clock: ThreadAwareClock) -> None:
    with pytest.raises(ConnectionRejected) as info:
        async with client("/refuse"):
            pass  # pragma: no cover
    assert info.value.status_code == 403


async def test_an_app_that_returns_leaves_a_normal_close(
        autojump_clock: ThreadAwareClock) -> None:
    async with client("/leave") as ws:
        with pytest.raises(ConnectionClosed) as info:
            await ws.get_message()
    assert info.value.reason.code == 1000


async def test_a_send_after_the_peer_left_fails(autojump_clock: ThreadAwareClock) -> None:
    async with client("/late"):
        pass
    assert SEEN == [("late send refused", "WebSocketDisconnect")]
