"""The stand-ins for a guest's TCP server (`kibotos.testing.tcp_servers`) do what the
port-forwarding tests rely on, with plain trio clients on loopback."""

from __future__ import annotations

import socket

import trio

from kibotos.testing.tcp_servers import echo, flood, read_all, sink, tcp_server, upper_after_eof

TIMEOUT = 60


async def _exchange(port: int, payload: bytes, host: str = "127.0.0.1") -> bytes:
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(payload)
        await stream.send_eof()
        return await read_all(stream)


async def test_each_server() -> None:
    with trio.fail_after(TIMEOUT):
        async with tcp_server(upper_after_eof) as port:
            assert await _exchange(port, b"abc") == b"ABC"
        async with tcp_server(echo) as port:
            assert await _exchange(port, b"x" * 300_000) == b"x" * 300_000
        async with tcp_server(sink) as port:
            assert await _exchange(port, b"y" * 123_457) == b"123457"
        async with tcp_server(flood(3_000_001, block=65536)) as port:
            assert await _exchange(port, b"") == b"\x5a" * 3_000_001


async def test_a_client_that_breaks_off_does_not_end_the_server() -> None:
    with trio.fail_after(TIMEOUT):
        async with tcp_server(flood(64 << 20)) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:  # closed with unread bytes: a reset for the server
                assert await stream.receive_some(10)
            assert len(await _exchange(port, b"")) == 64 << 20  # the next one is served


async def test_the_server_stops_with_its_block() -> None:
    async with tcp_server(echo) as port:
        pass
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0
