"""What ``kibo workspace port-forward`` does, run in this process against a data plane on
loopback and the real guest agent: local listeners, 50 concurrent connections each on
its own stream, half-close both ways, a message per connection that finds nothing
listening, and the session credential renewed before (and after) it expires.  The
command as a process, through a real ctrl, is in test_exec_e2e.py."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import trio
from dp_harness import TIMEOUT, Plane, in_process_plane, running_agent, target

from kibotos.cli.workspace.port_forward_cmds import (
    Forwarder,
    Mapping,
    SessionSource,
    parse_addresses,
    parse_mapping,
)
from kibotos.core.credentials import SigningKey
from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.testing.tcp_servers import read_all, tcp_server, upper_after_eof


def session_body(plane: Plane, *, issued: float | None = None,
                 key: SigningKey | None = None) -> dict[str, Any]:
    """What ctrl answers to ``POST …/sessions {"operations": ["ports"]}``."""
    credential, claims = (key or plane.key).issue(
        workspace_id="ws-1", instance_id="inst-1", node_id="node-a", operations=("ports",),
        now=issued)
    return {"dataplane_url": plane.url, "credential": credential, "instance_id": "inst-1",
            "expires_at": datetime.fromtimestamp(claims.exp, UTC).isoformat()}


def test_mappings_and_addresses() -> None:
    assert parse_mapping("8080") == Mapping(8080, 8080)
    assert parse_mapping("8000:80") == Mapping(8000, 80)
    assert parse_mapping(":5432") == Mapping(0, 5432)
    for bad in ("0", "x", "80:", "1:2:3", "70000", "-1:80", ""):
        with pytest.raises(InvalidArgument, match="LOCAL"):
            parse_mapping(bad)
    assert parse_addresses(()) == (["127.0.0.1"], set())
    assert parse_addresses(("localhost",)) == (["127.0.0.1", "::1"], {"::1"})
    assert parse_addresses(("localhost,::1", "10.0.0.1")) == (
        ["127.0.0.1", "::1", "10.0.0.1"], set())
    with pytest.raises(InvalidArgument, match="not an IP address"):
        parse_addresses(("example.com",))


@asynccontextmanager
async def forwarding(plane: Plane, fetch: Callable[[], Any], first: Any,
                     mappings: list[Mapping]) -> AsyncIterator[
                         tuple[list[tuple[str, int, int]], list[str], SessionSource]]:
    """A Forwarder for the block; yields what it bound, its messages and its source."""
    messages: list[str] = []
    source = SessionSource(fetch, first)
    forwarder = Forwarder(source, mappings, ["127.0.0.1"], line=lambda text: None,
                          message=messages.append)
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(forwarder.run)
        yield bound, messages, source
        nursery.cancel_scope.cancel()


async def ask(port: int, payload: bytes) -> bytes:
    """One local client: send, half-close, read the answer to its end."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(payload)
        await stream.send_eof()
        return await read_all(stream)


async def test_fifty_connections_half_close_and_a_refused_port(tmp_path: Path) -> None:
    closed_port = socket.socket()
    closed_port.bind(("127.0.0.1", 0))
    nothing = closed_port.getsockname()[1]
    closed_port.close()
    greeting = trio.Event()
    heard = bytearray()

    async def greet_then_listen(stream: trio.SocketStream) -> None:
        await stream.send_all(b"hello")
        await stream.send_eof()
        heard.extend(await read_all(stream))
        greeting.set()

    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            first = session_body(plane)
            async with tcp_server(upper_after_eof) as upper, \
                    tcp_server(greet_then_listen) as greeter, \
                    forwarding(plane, lambda: session_body(plane), first,
                               [Mapping(0, upper), Mapping(0, nothing),
                                Mapping(0, greeter)]) as (bound, messages, _):
                local = {remote: port for _, port, remote in bound}
                answers: dict[int, bytes] = {}

                async def one(i: int) -> None:
                    answers[i] = await ask(local[upper], b"request %d " % i * (1 + i * 300))

                with trio.fail_after(TIMEOUT * 2):
                    async with trio.open_nursery() as nursery:
                        for i in range(50):
                            nursery.start_soon(one, i)
                assert answers == {i: b"REQUEST %d " % i * (1 + i * 300) for i in range(50)}

                # The server's half-close reaches the local client, which still sends.
                with trio.fail_after(TIMEOUT):
                    stream = await trio.open_tcp_stream("127.0.0.1", local[greeter])
                    async with stream:
                        assert await read_all(stream) == b"hello"
                        await stream.send_all(b"and back")
                        await stream.send_eof()
                        await greeting.wait()
                assert bytes(heard) == b"and back"

                # Nothing listens: the local connection is reset, stderr says why.
                with trio.fail_after(TIMEOUT):
                    with pytest.raises(trio.BrokenResourceError):
                        await ask(local[nothing], b"anyone?")
                    while not messages:
                        await trio.sleep(0.01)
                assert len(messages) == 1, messages
                assert messages[0].startswith(
                    f"error: 127.0.0.1:{local[nothing]} -> {nothing}: nothing listens on "
                    f"port {nothing} in the guest (connection refused on 127.0.0.1"), messages


async def test_the_credential_is_renewed_for_new_connections(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            # First an expired credential (the data plane would refuse it), then one
            # about to expire, then a fresh one.
            now = time.time()
            bodies = [session_body(plane, issued=now - 280), session_body(plane)]
            fetched: list[dict[str, Any]] = []

            def fetch() -> Any:
                fetched.append(bodies.pop(0) if bodies else session_body(plane))
                return fetched[-1]

            expired = session_body(plane, issued=now - 400)
            async with tcp_server(upper_after_eof) as upper, forwarding(
                    plane, fetch, expired, [Mapping(0, upper)]) as (bound, messages, source):
                port = bound[0][1]
                with trio.fail_after(TIMEOUT):
                    assert await ask(port, b"one") == b"ONE"
                    assert source.renewals == 1
                    assert await ask(port, b"two") == b"TWO"  # that one was due too
                    assert source.renewals == 2
                    assert await ask(port, b"three") == b"THREE"
                    assert source.renewals == 2  # the fresh one lasts
                assert messages == []
                assert source.session.credential == fetched[-1]["credential"]
            # Renewed before use: the expired credential never reached the data plane.
            assert plane.server is not None
            assert "rejected_total{" not in plane.server.metrics.text()

            # A credential the data plane refuses although it has not expired (signed
            # with another key: a clock or key that changed) is renewed at once.
            stranger = session_body(plane, key=SigningKey.generate())
            async with tcp_server(upper_after_eof) as upper, forwarding(
                    plane, lambda: session_body(plane), stranger,
                    [Mapping(0, upper)]) as (bound, messages, source):
                with trio.fail_after(TIMEOUT):
                    assert await ask(bound[0][1], b"four") == b"FOUR"
                assert (source.renewals, messages) == (1, [])
            assert ('connections_rejected_total{code="unauthenticated"} 1.0'
                    in plane.server.metrics.text())


async def test_a_refused_renewal_ends_the_forwarding(tmp_path: Path) -> None:
    async with in_process_plane(tmp_path) as plane:
        def fetch() -> Any:
            raise FailedPrecondition("workspace ws-1 is STOPPED, not AVAILABLE")

        source = SessionSource(fetch, session_body(plane, issued=time.time() - 290))
        failures: list[Exception] = []
        warnings: list[str] = []
        with trio.fail_after(TIMEOUT):
            await source.run(failures.append, warnings.append)
        assert [str(f) for f in failures] == ["workspace ws-1 is STOPPED, not AVAILABLE"]
        assert warnings == []


async def test_a_local_port_in_use_is_refused(tmp_path: Path) -> None:
    async with in_process_plane(tmp_path) as plane:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            taken = holder.getsockname()[1]
            source = SessionSource(lambda: None, session_body(plane))
            forwarder = Forwarder(source, [Mapping(taken, 80)], ["127.0.0.1"],
                                  line=lambda text: None, message=lambda text: None)
            with pytest.raises(InvalidArgument, match=f"cannot listen on 127.0.0.1:{taken}"):
                await forwarder.run()
