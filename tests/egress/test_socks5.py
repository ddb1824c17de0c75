"""The SOCKS5 client against a real server (microsocks on loopback, checking username
and password), and against servers that break the protocol on purpose."""

from __future__ import annotations

import functools

import pytest
import trio
from loopbed import banner, free_port

from kibotos.egress import socks5
from kibotos.egress.socks5 import SocksError


async def through(port: int, host: str, dest: int, **creds):
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        bound, early = await socks5.connect(stream, host, dest, **creds)
    except BaseException:
        await stream.aclose()
        raise
    return stream, bound, early


async def test_connect_with_username_and_password_reaches_the_destination(
        microsocks, tcp_server):
    server = microsocks("alice", "s3cret")
    target = tcp_server()
    with trio.fail_after(20):
        stream, bound, early = await through(server.port, "127.0.0.1", target.port,
                                             username="alice", password="s3cret")
        async with stream:
            assert early == b""
            assert isinstance(bound[1], int)
            await stream.send_all(b"ping through socks")
            assert await stream.receive_some(64) == b"ping through socks"
    assert target.accepted == 1


async def test_bytes_the_destination_sends_first_are_kept(microsocks, tcp_server):
    server = microsocks("alice", "s3cret")
    target = tcp_server(banner)
    with trio.fail_after(20):
        stream, _, early = await through(server.port, "127.0.0.1", target.port,
                                         username="alice", password="s3cret")
        async with stream:
            received = early
            while not received.endswith(b"\r\n"):
                received += await stream.receive_some(64)
            assert received == b"HELLO FROM THE DESTINATION\r\n"


@pytest.mark.parametrize(("creds", "message"), [
    ({"username": "alice", "password": "wrong"}, "refused the username and password"),
    ({"username": "mallory", "password": "s3cret"}, "refused the username and password"),
    ({}, "accepts none of the offered methods"),
])
async def test_the_server_refuses_wrong_or_missing_credentials(microsocks, tcp_server,
                                                              creds, message):
    server = microsocks("alice", "s3cret")
    target = tcp_server()
    with trio.fail_after(20), pytest.raises(SocksError, match=message):
        await through(server.port, "127.0.0.1", target.port, **creds)
    assert target.accepted == 0


async def test_without_credentials_against_an_open_server(microsocks, tcp_server):
    server = microsocks(None, None)
    target = tcp_server()
    with trio.fail_after(20):
        stream, _, _ = await through(server.port, "127.0.0.1", target.port)
        async with stream:
            await stream.send_all(b"x")
            assert await stream.receive_some(8) == b"x"


async def test_a_refused_destination_is_the_servers_reply(microsocks):
    server = microsocks("alice", "s3cret")
    with trio.fail_after(20), pytest.raises(SocksError, match="refused CONNECT to "):
        await through(server.port, "127.0.0.1", free_port(), username="alice",
                      password="s3cret")




@pytest.mark.parametrize(("script", "message"), [
    ([b"\x04\x00"], "SOCKS version 4, not 5"),
    ([b"\x05\x00"], "chose method 0x00, which was not offered"),
    ([b"\x05\x02", b"\x01\x00", b"\x05\x00\x00\x07"], "address type 7"),
    ([b"\x05\x02", b"\x01\x00", b"\x05\x00\x00\x01\x7f\x00"],
     "closed the connection during the CONNECT reply"),
    ([b"\x05\x02", b"\x02\x00"], "answered authentication with version 2"),
    ([b"\x05\x02", b"\x01\x00", b"\x05\x00\x09\x01"], "reserved byte is not zero"),
])
async def test_protocol_errors_are_named(script, message):
    """A server that answers each of the client's messages with the next scripted
    bytes and then closes."""
    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            for reply in script:
                await stream.receive_some(1024)
                await stream.send_all(reply)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, host="127.0.0.1"),
                                        handler, 0)
        port = listeners[0].socket.getsockname()[1]
        with trio.fail_after(20), pytest.raises(SocksError, match=message):
            await through(port, "198.18.0.1", 80, username="u", password="p")
        nursery.cancel_scope.cancel()


def test_destination_encoding():
    assert socks5._destination("198.18.0.1", 80) == b"\x01\xc6\x12\x00\x01\x00\x50"
    assert socks5._destination("2001:2::1", 443)[:1] == b"\x04"
    assert socks5._destination("files.test", 80) == b"\x03\x0afiles.test\x00\x50"
