"""A simulated node that speaks the control session protocol, for tests and benchmarks.

It is a real WebSocket client (trio-websocket) against a real ctrl, with the knobs a
test needs to play a misbehaving node: a skewed clock, overcommit acks withheld, pings
stopped, arbitrary frames sent.  It is not the node role (`kibotos.node`), which runs
VMs; it only plays its side of the session.  Its Instances are simulated
(`kibotos.testing.sim_instances`): it answers the Instance commands, reports their
states, and announces one private default storage pool (``<node_id>-local``) unless
`pools` says otherwise.

    async with open_sim_node(url, credential, "node-a", incarnation=1) as node:
        assert node.first["type"] == "welcome"
        await node.send_report(instance_count=1)
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    WebSocketConnection,
    wrap_client_stream,
)

from kibotos.core.errors import Internal, KibotosError
from kibotos.testing.sim_instances import SimInstances

SESSION_PATH = "/v1/node/session"


def default_report() -> dict[str, Any]:
    return {"allocated": {"cpu_millis": 0, "memory_bytes": 0}, "instance_count": 0,
            "volume_count": 0, "memory_tight": False, "memory_tight_since": None}


def default_sample() -> dict[str, Any]:
    return {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vm_cpu_cores": None,
            "vm_memory_bytes": None, "memory_available_bytes": 6 << 30,
            "memory_total_bytes": 8 << 30, "memory_tight": False, "memory_tight_since": None,
            "cpu_idle_ratio": 0.9, "cpu_pressure": {"some": 0.0, "full": 0.0},
            "memory_pressure": {"some": 0.0, "full": 0.0}}


@dataclass
class SimNode:
    ws: WebSocketConnection
    node_id: str
    incarnation: int
    #: The answer to hello: ``welcome`` or ``rejected``.
    first: dict[str, Any]
    clock_skew: float = 0.0
    ack_overcommit: bool = True
    answer_probes: bool = True
    sample: Callable[[], dict[str, Any]] = default_sample
    #: The simulated Instances; commands of other kinds (and all of them without one)
    #: are received and never answered, for the test to answer by hand.
    sim: SimInstances | None = None
    #: Every frame ctrl sent after the first, in order.
    received: list[dict[str, Any]] = field(default_factory=list)
    closed: trio.Event = field(default_factory=trio.Event)
    close_reason: str | None = None
    _changed: trio.Event = field(default_factory=trio.Event)
    _nursery: trio.Nursery | None = None

    @property
    def welcomed(self) -> bool:
        return self.first.get("type") == "welcome"

    async def send(self, message: dict[str, Any]) -> None:
        await self.ws.send_message(json.dumps(message))

    async def send_quietly(self, message: dict[str, Any]) -> None:
        """`send`, ignoring a session that closed (background frames of the simulation)."""
        with suppress(ConnectionClosed):
            await self.send(message)

    async def send_report(self, **fields: Any) -> None:
        await self.send({"type": "report", **{**default_report(), **fields}})

    async def wait_for(self, kind: str, *, after: int = 0,
                       timeout: float = 30.0) -> dict[str, Any]:
        """The first frame of type `kind` at index ≥ `after` in `received`."""
        with trio.fail_after(timeout):
            while True:
                for message in self.received[after:]:
                    if message.get("type") == kind:
                        return message
                if self.closed.is_set():
                    raise ConnectionError(f"session closed ({self.close_reason}) "
                                          f"before a {kind} frame arrived")
                await self._changed.wait()

    def _note(self, message: dict[str, Any]) -> None:
        self.received.append(message)
        self._changed.set()
        self._changed = trio.Event()

    async def _serve(self) -> None:
        try:
            while True:
                message = json.loads(await self.ws.get_message())
                self._note(message)
                kind = message.get("type")
                if kind == "clock_probe" and self.answer_probes:
                    await self.send({"type": "clock_reply", "id": message["id"],
                                     "node_time": time.time() + self.clock_skew,
                                     "sync_status": "synchronized"})
                elif kind == "usage_request" and self.answer_probes:
                    await self.send({"type": "usage", "id": message["id"],
                                     "sample": self.sample()})
                elif kind == "overcommit" and self.ack_overcommit:
                    await self.send({"type": "overcommit_ack", "serial": message["serial"]})
                elif kind == "command" and self.sim is not None and \
                        self.sim.handles(str(message.get("kind"))):
                    assert self._nursery is not None
                    self._nursery.start_soon(self._command, message)
                elif kind == "close":
                    self.close_reason = str(message.get("reason"))
        except ConnectionClosed as exc:
            if self.close_reason is None and exc.reason is not None:
                self.close_reason = str(exc.reason.reason or exc.reason.name)
        finally:
            self.closed.set()
            self._changed.set()

    async def _command(self, message: dict[str, Any]) -> None:
        assert self.sim is not None
        reply: dict[str, Any] = {"type": "command_result", "id": message.get("id")}
        try:
            args = message.get("args")
            result = await self.sim.handle(str(message.get("kind")),
                                           args if isinstance(args, dict) else {})
            reply.update(ok=True, result=result)
        except KibotosError as exc:
            reply.update(ok=False, error=exc.to_wire()["error"])
        except Exception as exc:  # a bug in the simulation must not end the session
            reply.update(ok=False, error=Internal(repr(exc)).to_wire()["error"])
        with suppress(ConnectionClosed):
            await self.send(reply)

    async def _ping(self, interval: float) -> None:
        while True:
            await trio.sleep(interval)
            try:
                await self.send({"type": "ping"})
            except ConnectionClosed:
                return


def default_pools(node_id: str) -> list[dict[str, Any]]:
    return [{"id": f"{node_id}-local", "shared": False, "default": True}]


def hello_message(node_id: str, incarnation: int, **overrides: Any) -> dict[str, Any]:
    message: dict[str, Any] = {
        "type": "hello", "node_id": node_id, "incarnation": incarnation,
        "release_version": "unreleased", "source_revision": "test",
        "resources": {"cpu_millis": 4000, "memory_bytes": 8 << 30},
        "report": default_report(), "dataplane_address": "127.0.0.1:7500",
        "facts": {"pools": default_pools(node_id)},
    }
    message.update(overrides)
    return message


@asynccontextmanager
async def _unwrap_rejection() -> AsyncIterator[None]:
    """A refused upgrade surfaces inside the connection's nursery; raise it bare, as
    ``open_websocket_url`` does, so a test can catch `ConnectionRejected`."""
    try:
        yield
    except BaseExceptionGroup as group:
        rejected, _ = group.split(ConnectionRejected)
        while isinstance(rejected, BaseExceptionGroup) and len(rejected.exceptions) == 1:
            rejected = rejected.exceptions[0]  # type: ignore[assignment]
        if isinstance(rejected, ConnectionRejected):
            raise rejected from None
        raise


@asynccontextmanager
async def open_sim_node(base_url: str, credential: str, node_id: str, incarnation: int, *,
                        ping_interval: float | None = 1.0, clock_skew: float = 0.0,
                        ack_overcommit: bool = True, answer_probes: bool = True,
                        sim: SimInstances | None = None, answer_commands: bool = True,
                        pools: list[dict[str, Any]] | None = None,
                        network: dict[str, Any] | None = None,
                        connect: Callable[[], Awaitable[trio.abc.Stream]] | None = None,
                        ssl_context: ssl.SSLContext | None = None,
                        **hello: Any) -> AsyncIterator[SimNode]:
    """Connect, say hello, and play the node until the block ends.  A refused upgrade
    raises trio-websocket's `ConnectionRejected` (with its ``status_code``).

    `sim` carries Instances over from an earlier session of the same node (a fresh one
    by default; None with ``answer_commands=False``: commands go unanswered).  `pools`
    replaces the announced storage pools (``hello.facts.pools``); `network` announces a
    network (``hello.facts.network``, e.g. ``{"public_egress": True}``; none by default,
    like a node without ``[network]``).  `connect` opens the stream instead of a TCP
    connection to `base_url` (whose host then only names the ``Host`` header):
    `kibotos.testing.asgi_websocket.InProcessConnector` reaches an in-process ctrl
    without a socket.  An ``https://`` `base_url` is reached over TLS verified with
    `ssl_context` (`kibotos.tls.local_ctrl.client_tls`).

    The stream is opened here and closed here: trio-websocket's client leaves its
    socket open when the server closes first, which a long test run would notice."""
    parts = urlsplit(base_url)
    assert parts.hostname is not None, base_url
    headers = [(b"Authorization", f"Bearer {credential}".encode())]
    if connect is not None:
        stream = await connect()
    else:
        assert parts.port is not None, base_url
        stream = await trio.open_tcp_stream(parts.hostname, parts.port)
        if parts.scheme == "https":
            assert ssl_context is not None, f"{base_url} needs the ssl_context to verify it"
            stream = trio.SSLStream(stream, ssl_context, server_hostname=parts.hostname,
                                    https_compatible=True)
    try:
        if isinstance(stream, trio.SSLStream):
            await stream.do_handshake()  # a certificate that does not verify fails here
        async with _unwrap_rejection(), trio.open_nursery() as ws_nursery:
            ws = await wrap_client_stream(ws_nursery, stream,  # type: ignore[arg-type]
                                          parts.hostname, SESSION_PATH,
                                          extra_headers=headers)
            if sim is None and answer_commands:
                sim = SimInstances()
            if pools is not None:
                hello["facts"] = {**hello.get("facts", {}), "pools": pools}
            if network is not None:
                hello["facts"] = {"pools": default_pools(node_id),
                                  **hello.get("facts", {}), "network": network}
            if sim is not None and "report" not in hello:
                hello["report"] = {**default_report(), **sim.report_fields()}
            await ws.send_message(json.dumps(hello_message(node_id, incarnation, **hello)))
            with trio.fail_after(30):
                first = json.loads(await ws.get_message())
            node = SimNode(ws=ws, node_id=node_id, incarnation=incarnation, first=first,
                           clock_skew=clock_skew, ack_overcommit=ack_overcommit,
                           answer_probes=answer_probes, sim=sim)
            async with trio.open_nursery() as nursery:
                node._nursery = nursery
                if sim is not None:
                    sim.bind(node.send_quietly, nursery)
                    if first.get("drain_requested") is not None:
                        sim.drain_requested = bool(first["drain_requested"])
                nursery.start_soon(node._serve)
                if ping_interval is not None and node.welcomed:
                    nursery.start_soon(node._ping, ping_interval)
                try:
                    yield node
                finally:
                    nursery.cancel_scope.cancel()
                    if sim is not None:
                        sim.bind(None, None)
            with trio.move_on_after(5):
                await ws.aclose()
            ws_nursery.cancel_scope.cancel()
    finally:
        await trio.aclose_forcefully(stream)
