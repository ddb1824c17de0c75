"""Real TCP servers on loopback that stand in for a server running in a guest, for the
port-forwarding tests and bench (the guest agent runs on the host there, so the
guest's loopback is the host's).

::

    async with tcp_server(upper_after_eof) as port:
        ...   # connect to 127.0.0.1:port

Each server is bounded in time by its caller's block: it stops when the block ends.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import trio

Handler = Callable[[trio.SocketStream], Awaitable[None]]


@asynccontextmanager
async def tcp_server(handler: Handler, host: str = "127.0.0.1") -> AsyncIterator[int]:
    """A server on `host` for the block; yields its port.  Each connection runs
    `handler` and is closed afterwards; a connection the client broke ends quietly."""
    async def serve(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                await handler(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return

    async with trio.open_nursery() as nursery:
        listeners: list[trio.SocketListener] = await nursery.start(
            functools.partial(trio.serve_tcp, serve, 0, host=host))
        yield int(listeners[0].socket.getsockname()[1])
        nursery.cancel_scope.cancel()


async def read_all(stream: trio.abc.ReceiveStream, chunk: int = 1 << 20) -> bytes:
    """Everything until EOF."""
    data = bytearray()
    while piece := await stream.receive_some(chunk):
        data += piece
    return bytes(data)


async def upper_after_eof(stream: trio.SocketStream) -> None:
    """Reads to the client's EOF, then answers the bytes in upper case."""
    await stream.send_all((await read_all(stream)).upper())


async def echo(stream: trio.SocketStream) -> None:
    """Sends back what arrives as it arrives; half-closes after the client's EOF."""
    while piece := await stream.receive_some(1 << 18):
        await stream.send_all(piece)
    await stream.send_eof()


async def sink(stream: trio.SocketStream) -> None:
    """Reads to EOF and answers the byte count as decimal ASCII."""
    total = 0
    while piece := await stream.receive_some(1 << 18):
        total += len(piece)
    await stream.send_all(str(total).encode())


def flood(size: int, block: int = 1 << 20) -> Handler:
    """A handler that sends `size` bytes (``0x5a``) and then closes."""
    async def send(stream: trio.SocketStream) -> None:
        data = b"\x5a" * block
        left = size
        while left > 0:
            await stream.send_all(data[:left])
            left -= len(data)

    return send
