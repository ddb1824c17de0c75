"""The ``ports`` capability through the real agent: a real TCP server on loopback stands
in for the guest's server; bytes both ways, half-close each way, a refused port, a
reset, many streams on one channel, and bounded memory for a reader that stalls."""

from __future__ import annotations

import hashlib
import socket
import struct

import pytest
import trio
from guest_harness import TIMEOUT, AgentProcess, connected, wait_until

from kibotos.core.errors import InvalidArgument, Unavailable
from kibotos.guest import GuestChannel
from kibotos.guest.ports import GuestPort
from kibotos.testing.tcp_servers import flood, read_all, tcp_server, upper_after_eof


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_bytes_both_ways_with_the_clients_half_close(guest: GuestChannel) -> None:
    async with tcp_server(upper_after_eof) as port:
        with trio.fail_after(TIMEOUT):
            async with await guest.ports.open(port) as conn:
                assert conn.address == f"127.0.0.1:{port}"
                await conn.send_all(b"hello, ")
                await conn.send_all(b"guest")
                await conn.send_eof()  # the server only answers after it read EOF
                assert await read_all(conn) == b"HELLO, GUEST"
                assert await conn.wait_ended() is None
                assert (conn.sent, conn.received) == (12, 12)
    assert guest.statistics().protocol_errors == 0


async def test_the_servers_half_close_reaches_the_client_and_sending_goes_on(
        guest: GuestChannel) -> None:
    received = trio.Event()
    got = bytearray()

    async def greet_then_listen(stream: trio.SocketStream) -> None:
        await stream.send_all(b"ready")
        await stream.send_eof()  # the server's side is done; it still reads
        got.extend(await read_all(stream))
        received.set()

    async with tcp_server(greet_then_listen) as port:
        with trio.fail_after(TIMEOUT):
            async with await guest.ports.open(port, host="127.0.0.1") as conn:
                assert await read_all(conn) == b"ready"  # EOF: the server shut down
                payload = bytes(range(256)) * 4096  # 1 MiB, more than a window
                await conn.send_all(payload)
                await conn.send_eof()
                await received.wait()
                assert bytes(got) == payload
                assert await conn.wait_ended() is None


async def test_nothing_listening_is_an_error_naming_the_port(guest: GuestChannel) -> None:
    port = free_port()
    with pytest.raises(Unavailable, match=f"nothing listens on port {port} in the guest") as e:
        await guest.ports.open(port)
    assert e.value.details["reason"] == "connection_refused"
    assert e.value.details["port"] == port
    assert "127.0.0.1" in e.value.details["addresses"]  # and ::1 where there is one
    with pytest.raises(Unavailable, match=r"\(connection refused on 127\.0\.0\.1\)$"):
        await guest.ports.open(port, host="127.0.0.1")
    with pytest.raises(InvalidArgument, match="host must be one of"):
        await guest.ports.open(port, host="10.0.0.1")
    with pytest.raises(InvalidArgument, match="port must be"):
        await guest.ports.open(0)
    assert guest.statistics().protocol_errors == 0


async def test_ipv6_loopback(guest: GuestChannel) -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    async with tcp_server(upper_after_eof, host="::1") as port:
        with trio.fail_after(TIMEOUT):
            # Unset host: 127.0.0.1 is refused, ::1 answers (what "localhost" means).
            async with await guest.ports.open(port) as conn:
                assert conn.address == f"[::1]:{port}"
                await conn.send_all(b"six")
                await conn.send_eof()
                assert await read_all(conn) == b"SIX"


async def test_many_concurrent_streams_on_one_channel(guest: GuestChannel) -> None:
    async def echo_digest(stream: trio.SocketStream) -> None:
        data = await read_all(stream)
        await stream.send_all(hashlib.sha256(data).digest() + data[:64])

    results: dict[int, bool] = {}

    async def one(i: int, port: int) -> None:
        payload = struct.pack("!I", i) * (1000 + 997 * i)
        async with await guest.ports.open(port) as conn:
            async with trio.open_nursery() as nursery:
                async def send() -> None:
                    await conn.send_all(payload)
                    await conn.send_eof()

                nursery.start_soon(send)
                answer = await read_all(conn)
            results[i] = answer == hashlib.sha256(payload).digest() + payload[:64]
            assert await conn.wait_ended() is None

    async with tcp_server(echo_digest) as port:
        with trio.fail_after(TIMEOUT * 2):
            async with trio.open_nursery() as nursery:
                for i in range(64):
                    nursery.start_soon(one, i, port)
    assert results == dict.fromkeys(range(64), True)
    assert guest.statistics().protocol_errors == 0


async def test_a_reset_by_the_server_is_an_error_not_an_eof(guest: GuestChannel) -> None:
    async def reset(stream: trio.SocketStream) -> None:
        await stream.receive_some(10)
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    async with tcp_server(reset) as port:
        with trio.fail_after(TIMEOUT):
            async with await guest.ports.open(port) as conn:
                await conn.send_all(b"x")
                with pytest.raises(trio.BrokenResourceError, match="reset by the guest's"):
                    await read_all(conn)
                error = await conn.wait_ended()
                assert isinstance(error, Unavailable)
                assert error.details["reason"] == "reset"
            # The guest kept the failed stream until port_close; the channel is fine.
            assert await guest.ping() >= 0
    assert guest.statistics().protocol_errors == 0


async def test_closing_early_closes_the_connection_in_the_guest(guest: GuestChannel) -> None:
    saw_end = trio.Event()

    async def endless(stream: trio.SocketStream) -> None:
        try:
            while True:
                await stream.send_all(b"z" * 65536)
        except trio.BrokenResourceError:
            saw_end.set()

    async with tcp_server(endless) as port:
        with trio.fail_after(TIMEOUT):
            conn = await guest.ports.open(port)
            assert await conn.receive_some(100)
            await conn.aclose()  # the server's frames still on their way are dropped
            await saw_end.wait()
            await guest.ping()
            assert (guest._ports, guest._outputs, guest._inputs) == ({}, {}, {})
    assert guest.statistics().protocol_errors == 0


async def test_the_session_ending_closes_its_connections(agent: AgentProcess) -> None:
    closed = trio.Event()

    async def wait_for_close(stream: trio.SocketStream) -> None:
        await read_all(stream)
        closed.set()

    async with tcp_server(wait_for_close) as port:
        with trio.fail_after(TIMEOUT):
            async with connected(agent) as guest:
                await guest.ports.open(port)
            await closed.wait()  # the host went away: the guest closed the socket


async def _stalled_then_drained(conn: GuestPort, agent: AgentProcess, size: int) -> int:
    baseline = agent.status_kib("VmHWM")
    await trio.sleep(1)  # read nothing: an agent not held back would pile it all up
    stalled = agent.status_kib("VmRSS") - baseline
    total = 0
    while chunk := await conn.receive_some(1 << 20):
        total += len(chunk)
        if total < 4 << 20:
            await trio.sleep(0.001)
    assert total == size
    assert stalled < 16 * 1024, f"the agent grew {stalled} KiB while the reader stalled"
    return agent.status_kib("VmHWM") - baseline


async def test_a_stalled_reader_holds_the_server_back(guest: GuestChannel,
                                                      agent: AgentProcess) -> None:
    size = 64 << 20
    async with tcp_server(flood(size)) as port:
        with trio.fail_after(TIMEOUT * 2):
            async with await guest.ports.open(port) as warm:  # warm the code paths
                await warm.send_eof()
                await read_all(warm)
            async with await guest.ports.open(port) as conn:
                grown = await _stalled_then_drained(conn, agent, size)
    assert grown < 16 * 1024, f"the agent's peak RSS grew by {grown} KiB for 64 MiB"


async def test_a_server_that_does_not_read_holds_the_sender_back(
        guest: GuestChannel, agent: AgentProcess) -> None:
    size = 64 << 20
    reading = trio.Event()
    got = 0

    async def slow_sink(stream: trio.SocketStream) -> None:
        nonlocal got
        await reading.wait()
        got = len(await read_all(stream))

    async with tcp_server(slow_sink) as port:
        with trio.fail_after(TIMEOUT * 2):
            async with await guest.ports.open(port) as conn:
                baseline = agent.status_kib("VmHWM")
                sent = 0

                async def send_everything() -> None:
                    nonlocal sent
                    while sent < size:
                        await conn.send_all(b"\x00" * 65536)
                        sent += 65536
                    await conn.send_eof()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(send_everything)
                    await trio.sleep(1)  # the sink reads nothing yet
                    # Only the guest's window and the kernel's socket buffers took bytes.
                    assert sent < 32 << 20, f"{sent} bytes went to a server that reads nothing"
                    reading.set()
                await wait_until(lambda: got == size, "the sink to read everything")
                grown = agent.status_kib("VmHWM") - baseline
    assert grown < 16 * 1024, f"the agent's peak RSS grew by {grown} KiB for 64 MiB"
