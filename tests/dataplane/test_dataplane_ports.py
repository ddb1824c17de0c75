"""Port forwarding through a data plane on loopback to the real guest agent, with a real
TCP server standing in for the guest's: credentials and refusals, bytes both ways with
half-close each way, a refused port, a reset, 50 concurrent connections, a client that
drops, and (with ``kibotos dataplane serve`` as a real process) bounded memory for a
reader or a server that stalls."""

from __future__ import annotations

import hashlib
import json
import socket
import struct
from pathlib import Path
from typing import Any

import pytest
import trio
from dp_harness import TIMEOUT, Plane, PlaneProcess, in_process_plane, running_agent, target

from kibotos.core.credentials import SigningKey
from kibotos.core.errors import InvalidArgument, PermissionDenied, Unauthenticated, Unavailable
from kibotos.dataplane.clients.ports_client import PortConnection, open_port
from kibotos.testing.tcp_servers import flood, read_all, tcp_server, upper_after_eof

PORTS = ("ports",)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def refused_upgrade(plane: Plane, path: str, credential: str) -> tuple[int, Any]:
    """A WebSocket upgrade by hand (what a gateway sends); the refusal's status and
    JSON body."""
    host, _, port = plane.listen.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(
            f"GET {path} HTTP/1.1\r\nHost: {plane.listen}\r\nConnection: Upgrade\r\n"
            "Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            f"Authorization: Bearer {credential}\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += await stream.receive_some(65536)
    return int(head.split()[1]), json.loads(body)


async def test_refusals_before_the_upgrade(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            port = free_port()
            with pytest.raises(Unauthenticated):
                async with open_port(plane.url, None, port):
                    pass
            with pytest.raises(PermissionDenied, match="does not grant 'ports'"):
                async with open_port(plane.url, plane.credential(), port):
                    pass
            creds = plane.credential(operations=PORTS)
            with pytest.raises(Unavailable, match=f"nothing listens on port {port}") as e:
                async with open_port(plane.url, creds, port):
                    pass
            assert e.value.details["reason"] == "connection_refused"
            with trio.fail_after(TIMEOUT):
                status, body = await refused_upgrade(plane, f"/v1/ports/{port}", creds)
                assert status == 502  # what a gateway can pass on
                assert body["error"]["details"]["port"] == port
                for path, message in (("/v1/ports/x", "must be a number"),
                                      ("/v1/ports/0", "must be a number"),
                                      ("/v1/ports/70000", "must be a number"),
                                      (f"/v1/ports/{port}?host=10.0.0.1", "host must be"),
                                      (f"/v1/ports/{port}?x=1", "unknown parameters")):
                    status, body = await refused_upgrade(plane, path, creds)
                    assert status == 400, path
                    assert message in body["error"]["message"], path
            with pytest.raises(InvalidArgument):
                async with open_port(plane.url, creds, 0):
                    pass
            assert plane.server is not None
            text = plane.server.metrics.text()
            assert ('kibotos_dataplane_ports_connect_failed_total{reason="connection_refused"}'
                    ' 2.0') in text


async def _through(plane: Plane, port: int, payload: bytes) -> bytes:
    async with open_port(plane.url, plane.credential(operations=PORTS), port) as conn:
        await conn.send_all(payload)
        await conn.send_eof()
        answer = await read_all(conn)
        assert await conn.finish() is None
        return answer


async def test_half_close_both_ways(tmp_path: Path) -> None:
    got = bytearray()
    done = trio.Event()

    async def greet_then_listen(stream: trio.SocketStream) -> None:
        await stream.send_all(b"ready")
        await stream.send_eof()  # the server's side is done; it still reads
        got.extend(await read_all(stream))
        done.set()

    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            with trio.fail_after(TIMEOUT):
                async with tcp_server(upper_after_eof) as port:
                    # The client's half-close reaches the server, which answers after it.
                    assert await _through(plane, port, b"abc" * 100_000) == b"ABC" * 100_000
                async with tcp_server(greet_then_listen) as port, open_port(
                        plane.url, plane.credential(operations=PORTS), port) as conn:
                    # The server's half-close reaches the client; sending goes on.
                    assert await read_all(conn) == b"ready"
                    payload = bytes(range(256)) * 8192
                    await conn.send_all(payload)
                    await conn.send_eof()
                    await done.wait()
                    assert bytes(got) == payload
                    assert await conn.finish() is None
            assert plane.server is not None
            text = plane.server.metrics.text()
            assert 'kibotos_dataplane_connections_total{operation="ports"} 2.0' in text
            assert 'kibotos_dataplane_ports_closed_total{outcome="ended"} 2.0' in text
            assert 'kibotos_dataplane_ports_bytes_total{direction="to_guest"}' in text


async def test_fifty_concurrent_connections(tmp_path: Path) -> None:
    async def digest(stream: trio.SocketStream) -> None:
        data = await read_all(stream)
        await stream.send_all(hashlib.sha256(data).digest() + data[:32])

    results: dict[int, bool] = {}

    async def one(plane: Plane, port: int, i: int) -> None:
        payload = struct.pack("!I", i) * (500 + 2011 * i)
        answer = await _through(plane, port, payload)
        results[i] = answer == hashlib.sha256(payload).digest() + payload[:32]

    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            async with tcp_server(digest) as port:
                with trio.fail_after(TIMEOUT * 2):
                    async with trio.open_nursery() as nursery:
                        for i in range(50):
                            nursery.start_soon(one, plane, port, i)
    assert results == dict.fromkeys(range(50), True)


async def test_a_reset_in_the_guest_reaches_the_client(tmp_path: Path) -> None:
    async def reset(stream: trio.SocketStream) -> None:
        await stream.receive_some(10)
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            async with tcp_server(reset) as port:
                with trio.fail_after(TIMEOUT):
                    async with open_port(plane.url, plane.credential(operations=PORTS),
                                         port) as conn:
                        await conn.send_all(b"x")
                        with pytest.raises(trio.BrokenResourceError, match="reset") as e:
                            await read_all(conn)
                        assert isinstance(e.value.__cause__, Unavailable)
                        assert e.value.__cause__.details["reason"] == "reset"


async def test_a_client_that_goes_away_closes_the_guests_connection(tmp_path: Path) -> None:
    closed = trio.Event()

    async def endless(stream: trio.SocketStream) -> None:
        try:
            while True:
                await stream.send_all(b"z" * 65536)
        finally:
            closed.set()

    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            async with tcp_server(endless) as port:
                with trio.fail_after(TIMEOUT):
                    async with open_port(plane.url, plane.credential(operations=PORTS),
                                         port) as conn:
                        assert await conn.receive_some()
                    await closed.wait()
                    # The channel to the guest is still good for the next one.
                    async with tcp_server(upper_after_eof) as port2:
                        assert await _through(plane, port2, b"next") == b"NEXT"
            assert plane.server is not None
            assert 'ports_closed_total{outcome="client_gone"} 1.0' in plane.server.metrics.text()


async def test_a_stopping_data_plane_closes_its_connections(tmp_path: Path) -> None:
    """What the drain's end does (`close_all`, after SIGTERM's 10 s): the client gets
    1001, the guest's connection is closed."""
    closed = trio.Event()

    async def wait_for_close(stream: trio.SocketStream) -> None:
        try:
            await read_all(stream)
        finally:
            closed.set()

    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            assert plane.server is not None
            async with tcp_server(wait_for_close) as port:
                with trio.fail_after(TIMEOUT):
                    async with open_port(plane.url, plane.credential(operations=PORTS),
                                         port) as conn:
                        await conn.send_all(b"hello")
                        assert await plane.server.connections.close_all() == 1
                        with pytest.raises(trio.BrokenResourceError,
                                           match="1001 data plane stopping"):
                            await conn.receive_some()
                    await closed.wait()
            assert 'ports_closed_total{outcome="stopping"} 1.0' in plane.server.metrics.text()


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


async def _drain_slowly(conn: PortConnection, size: int) -> None:
    total = 0
    while chunk := await conn.receive_some():
        total += len(chunk)
        if total < 8 << 20:
            await trio.sleep(0.002)
    assert total == size


async def test_a_stalled_end_does_not_grow_the_data_planes_memory(tmp_path: Path) -> None:
    """Through ``kibotos dataplane serve`` as its own process: 128 MiB to a client that
    reads nothing for a while and then slowly, and 128 MiB from a client to a server
    that does the same; the process's peak RSS grows by a few windows at most."""
    size = 128 << 20
    reading = trio.Event()
    got = 0

    async def slow_sink(stream: trio.SocketStream) -> None:
        nonlocal got
        await reading.wait()
        while chunk := await stream.receive_some(1 << 16):
            got += len(chunk)
            if got < 8 << 20:
                await trio.sleep(0.002)

    key = SigningKey.generate()
    dp = PlaneProcess(tmp_path)
    try:
        with running_agent(tmp_path) as agent:
            await dp.wait_serving()
            plane = dp.plane(key)
            await plane.hand_state(target(agent))
            creds = plane.credential(operations=PORTS)
            with trio.fail_after(TIMEOUT * 3):
                async with tcp_server(upper_after_eof) as warm:  # warm the code paths
                    assert await _through(plane, warm, b"w" * (4 << 20)) == b"W" * (4 << 20)
                baseline = _kib(dp.proc.pid, "VmHWM")
                async with tcp_server(flood(size)) as port, open_port(
                        plane.url, creds, port) as conn:
                    await trio.sleep(1)  # read nothing
                    stalled = _kib(dp.proc.pid, "VmRSS") - baseline
                    await conn.send_eof()
                    await _drain_slowly(conn, size)
                async with tcp_server(slow_sink) as port, open_port(
                        plane.url, creds, port) as conn:
                    block = b"\x00" * (1 << 20)
                    sent = 0

                    async def send_everything() -> None:
                        nonlocal sent
                        while sent < size:
                            await conn.send_all(block)
                            sent += len(block)
                        await conn.send_eof()

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(send_everything)
                        await trio.sleep(1)  # the server reads nothing
                        assert sent < 48 << 20, f"{sent} bytes left a client for a stalled server"
                        reading.set()
                    assert await read_all(conn) == b""
                    assert got == size
            grown = _kib(dp.proc.pid, "VmHWM") - baseline
    finally:
        dp.stop()
    print(f"data plane: stalled +{stalled} KiB, peak +{grown} KiB")
    assert stalled < 16 * 1024, f"the data plane grew {stalled} KiB while the client stalled"
    assert grown < 24 * 1024, f"the data plane's peak RSS grew {grown} KiB for 2 × 128 MiB"
