"""The node control session: the WebSocket endpoint ``/v1/node/session`` and the live
sessions of this ctrl process (`SessionHub`, the `SessionRegistry` of `CtrlContext`).

One `NodeSession` per connection runs three tasks in its own nursery: a writer (the
only task that sends, fed by a channel, so frames never interleave), a reader (which
declares the session dead after ``session_timeout`` of silence, or at once when the
socket closes) and the overcommit pusher (which closes the session when the node does
not acknowledge a new ratio within ``overcommit_ack_timeout``).  Requests from other
tasks (clock probes, usage, commands) wait on a per-ID slot that the reader fills;
when the session ends, every waiter gets `Unavailable`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, MutableMapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any, Protocol

import trio
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from kibotos.config import CtrlSection
from kibotos.core import ids
from kibotos.core.errors import (
    DeadlineExceeded,
    KibotosError,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    error_from_wire,
)
from kibotos.ctrl.api.auth import Authenticator, Caller
from kibotos.ctrl.model import session_store as ss
from kibotos.ctrl.store.db import Store
from kibotos.protocol import (
    Args,
    ClockProbe,
    ClockReply,
    Close,
    CloseReason,
    Command,
    CommandResult,
    Hello,
    InstanceState,
    Message,
    Overcommit,
    OvercommitAck,
    Pong,
    ProtocolError,
    Ratios,
    Rejected,
    RejectReason,
    Report,
    Usage,
    UsageRequest,
    Welcome,
    decode,
    encode,
    parse,
)
from kibotos.protocol.values import clip

log = logging.getLogger("kibotos.ctrl.live.node_sessions")


@dataclass
class _Waiter:
    event: trio.Event = field(default_factory=trio.Event)
    value: dict[str, Any] | None = None
    received_at: float = 0.0
    error: KibotosError | None = None


#: How long an unchanged report may go unwritten: a report's stored time is at most
#: this old while the node keeps sending the same figures.
REPORT_REFRESH_S = 10.0


class NodeSession:
    def __init__(self, hub: SessionHub, ws: WebSocket, caller: Caller, hello: Hello,
                 session_id: str) -> None:
        self.hub = hub
        self.ws = ws
        self.identity_id = caller.identity_id
        self.node_id = hello.node_id
        self.incarnation = hello.incarnation
        self.session_id = session_id
        self.close_reason: str | None = None
        self.ended = trio.Event()
        self._send_tx, self._send_rx = trio.open_memory_channel[Message](256)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Waiter] = {}
        self._scope = trio.CancelScope()
        self._overcommit_wanted = trio.Event()
        self._acked_serial = -1
        #: The stored fields of the last report written, and when (`_store_report`).
        self._report_kept: tuple[tuple[Any, ...], float] | None = None
        self._ack_changed = trio.Event()

    # -------------------------------------------------------------- used by others

    def send_nowait(self, message: Message) -> None:
        try:
            self._send_tx.send_nowait(message)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise Unavailable(f"the control session of node {self.node_id} has ended") from None
        except trio.WouldBlock:
            raise Unavailable(f"the control session of node {self.node_id} is congested") from None

    async def request(self, make: Callable[[int], Message], timeout: float) -> _Waiter:
        """Send the message `make` builds with a fresh ``id`` and wait for the reply
        carrying it."""
        request_id = next(self._ids)
        message = make(request_id)
        waiter = _Waiter()
        self._pending[request_id] = waiter
        try:
            self.send_nowait(message)
            with trio.move_on_after(timeout):
                await waiter.event.wait()
        finally:
            self._pending.pop(request_id, None)
        if waiter.error is not None:
            raise waiter.error
        if not waiter.event.is_set():
            raise DeadlineExceeded(
                f"node {self.node_id} did not answer {message.type_name()} within "
                f"{timeout:g} s")
        return waiter

    async def measure_clock(self) -> None:
        """offset = node_time − midpoint(send, receive); uncertainty = half the round trip."""
        sent = time.time()
        waiter = await self.request(lambda i: ClockProbe(id=i),
                                    self.hub.settings.session_timeout)
        assert waiter.value is not None
        reply = parse(ClockReply, waiter.value)
        received = waiter.received_at
        offset_ms = (reply.node_time - (sent + received) / 2) * 1000.0
        uncertainty_ms = max(0.0, (received - sent) / 2 * 1000.0)
        if not math.isfinite(offset_ms):
            raise ProtocolError("clock_reply.node_time is not a finite number")
        await self.hub.store.write(partial(
            ss.store_clock, node_id=self.node_id, session_id=self.session_id,
            offset_ms=offset_ms, uncertainty_ms=uncertainty_ms,
            sync_status=reply.sync_status.value, now=self.hub.now()))

    async def _store_report(self, report: Report) -> bool:
        """Write the report's fields, unless they are the ones this session wrote less
        than `REPORT_REFRESH_S` ago: a node reports whenever its Instance list changes
        (twice per create), and the second write of a create would change nothing but
        the report's time (docs/architecture.md, "Node reports").  Whether the report
        counts (False: the node has since started another session)."""
        kept = (report.allocated.cpu_millis, report.allocated.memory_bytes,
                report.instance_count, report.volume_count, report.memory_tight,
                report.memory_tight_since)
        now = trio.current_time()
        if (report.facts is None and self._report_kept is not None
                and self._report_kept[0] == kept
                and now - self._report_kept[1] < REPORT_REFRESH_S):
            return True
        stored: bool = await self.hub.store.write(partial(
            ss.store_report, node_id=self.node_id, session_id=self.session_id,
            report=report, now=self.hub.now()))
        self._report_kept = (kept, now) if stored else None
        return stored

    async def fetch_usage(self) -> None:
        waiter = await self.request(lambda i: UsageRequest(id=i),
                                    self.hub.settings.session_timeout)
        assert waiter.value is not None
        usage = parse(Usage, waiter.value)
        await self.hub.store.write(partial(
            ss.store_usage, node_id=self.node_id, session_id=self.session_id,
            sample=usage.sample, now=self.hub.now()))

    async def call(self, args: Args, timeout: float) -> dict[str, Any]:
        """Send the command whose arguments `args` are and wait for its result."""
        return await self.call_wire(args.KIND, args.to_wire(), timeout)

    async def call_wire(self, kind: str, args: dict[str, Any], timeout: float
                        ) -> dict[str, Any]:
        """`call` with the command as it travels (another replica relayed it)."""
        waiter = await self.request(
            lambda i: Command(id=i, kind=kind, args=args), timeout)
        assert waiter.value is not None
        result = parse(CommandResult, waiter.value)
        if not result.ok:
            raise error_from_wire({"error": result.error.to_wire() if result.error else {}})
        return result.result or {}

    def push_overcommit(self) -> None:
        self._overcommit_wanted.set()

    async def close(self, reason: CloseReason, *, wait: float = 5.0) -> None:
        """Tell the node why, close the socket, and wait (briefly) for the end."""
        if self.close_reason is None:
            self.close_reason = reason
            try:
                self.send_nowait(Close(reason=reason))
            except Unavailable:
                self._scope.cancel()
        with trio.move_on_after(wait):
            await self.ended.wait()
        self._scope.cancel()

    # ------------------------------------------------------------------- running

    async def run(self, welcome: Welcome) -> None:
        self.send_nowait(welcome)
        with self._scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer)
                nursery.start_soon(self._reader)
                nursery.start_soon(self._overcommit_pusher)
                nursery.start_soon(self._initial_measurements)
        self._send_tx.close()
        for waiter in self._pending.values():
            waiter.error = Unavailable(f"the control session of node {self.node_id} ended")
            waiter.event.set()

    async def _writer(self) -> None:
        try:
            async for message in self._send_rx:
                await self.ws.send_text(encode(message))
                if isinstance(message, Close):
                    await self.ws.close(1000, message.reason.value[:100])
                    self._end(message.reason.value)
                    return
        except (WebSocketDisconnect, RuntimeError, OSError):
            self._end("socket closed")

    async def _reader(self) -> None:
        timeout = self.hub.settings.session_timeout
        while True:
            message: MutableMapping[str, Any] | None = None
            with trio.move_on_after(timeout):
                message = await self.ws.receive()
            if message is None:
                log.warning("node %s: no message for %g s, session %s is dead",
                            self.node_id, timeout, self.session_id)
                self._end("timeout")
                return
            if message["type"] == "websocket.disconnect":
                self._end("socket closed")
                return
            received_at = time.time()
            try:
                text = message.get("text")
                if text is None:
                    raise ProtocolError("binary frames are not part of the protocol")
                await self._dispatch(decode(text), received_at)
            except ProtocolError as exc:
                log.warning("node %s: protocol error: %s", self.node_id, exc)
                self.close_reason = self.close_reason or CloseReason.PROTOCOL_ERROR
                self.send_nowait(Close(reason=CloseReason.PROTOCOL_ERROR))
                return

    def _end(self, reason: str) -> None:
        self.close_reason = self.close_reason or reason
        self._scope.cancel()

    async def _dispatch(self, data: dict[str, Any], received_at: float) -> None:
        kind = data["type"]
        if kind == "ping":
            self.send_nowait(Pong())
        elif kind in ("clock_reply", "usage", "command_result"):
            request_id = data.get("id")
            waiter = self._pending.get(request_id) if isinstance(request_id, int) else None
            if waiter is not None:
                waiter.value = data
                waiter.received_at = received_at
                waiter.event.set()
        elif kind == "report":
            report = parse(Report, data)
            if await self._store_report(report):
                await self.hub.notify("node_report", self.node_id, report)
        elif kind == "instance_state":
            await self.hub.notify("instance_state", self.node_id,
                                  parse(InstanceState, data))
        elif kind == "overcommit_ack":
            ack = parse(OvercommitAck, data)
            self._acked_serial = max(self._acked_serial, ack.serial)
            self._ack_changed.set()
            self._ack_changed = trio.Event()
        else:
            log.info("node %s: ignoring unknown message type %r", self.node_id, kind)

    async def _overcommit_pusher(self) -> None:
        ack_timeout = self.hub.settings.overcommit_ack_timeout
        while True:
            await self._overcommit_wanted.wait()
            self._overcommit_wanted = trio.Event()
            message = await self.hub.store.run(partial(
                ss.overcommit_to_push, node_id=self.node_id, session_id=self.session_id))
            if message is None:
                continue
            serial = int(message["serial"])
            self.send_nowait(Overcommit(**message))
            with trio.move_on_after(ack_timeout):
                while self._acked_serial < serial:
                    await self._ack_changed.wait()
            if self._acked_serial < serial:
                log.warning("node %s did not acknowledge overcommit serial %d within %g s",
                            self.node_id, serial, ack_timeout)
                self.close_reason = self.close_reason or CloseReason.OVERCOMMIT_ACK_TIMEOUT
                self.send_nowait(Close(reason=CloseReason.OVERCOMMIT_ACK_TIMEOUT))
                return
            await self.hub.store.write(partial(
                ss.confirm_overcommit, node_id=self.node_id, session_id=self.session_id,
                serial=serial))

    async def _initial_measurements(self) -> None:
        for step in (self.measure_clock, self.fetch_usage):
            try:
                await step()
            except (KibotosError, ProtocolError) as exc:
                log.warning("node %s: session start %s failed: %s",
                            self.node_id, step.__name__, exc)


class SessionObserver(Protocol):
    """A part of ctrl that follows what nodes say (the Workspace service): told when a
    session starts (after the welcome is queued) and ends, of every stored report and
    of every ``instance_state``.  Called in the session's reader, in order; an error is
    logged and never ends the session."""

    async def session_started(self, node_id: str, hello: Hello) -> None: ...

    async def node_report(self, node_id: str, report: Report) -> None: ...

    async def instance_state(self, node_id: str, frame: InstanceState) -> None: ...

    async def session_ended(self, node_id: str) -> None: ...


class RemoteSessions(Protocol):
    """The sessions other ctrl replicas hold (`kibotos.ctrl.relay.CommandRelay`)."""

    def alive_elsewhere(self) -> AbstractSet[str]:
        """The nodes whose live session another live replica holds (as last read)."""

    async def call(self, node_id: str, args: Args, timeout: float) -> dict[str, object]:
        """Have the replica holding the node's session send the command."""

    async def close(self, node_id: str, reason: CloseReason) -> None:
        """Have the replica holding the node's session close it."""


class SessionHub:
    """The live sessions of this process, by node ID (one per node); commands for a
    node whose session another replica holds go through `remote`."""

    def __init__(self, store: Store, settings: CtrlSection,
                 now: Callable[[], datetime]) -> None:
        self.store = store
        self.settings = settings
        self.now = now
        #: The ctrl replica this hub's sessions are recorded under (several replicas
        #: on PostgreSQL, `kibotos.ctrl.replica`); None for a lone ctrl on SQLite.
        self.replica_id: str | None = None
        self.remote: RemoteSessions | None = None
        self._sessions: dict[str, NodeSession] = {}
        self.observers: list[SessionObserver] = []
        #: Sent in every welcome so the node's data plane can verify session
        #: credentials (set by `serve.build_context` from ctrl's signing key).
        self.session_signing_public_key: str | None = None

    async def notify(self, event: str, node_id: str, *args: Any) -> None:
        """Call `event` on every observer; failures are logged, not raised."""
        for observer in list(self.observers):
            try:
                await getattr(observer, event)(node_id, *args)
            except (KibotosError, ProtocolError) as exc:
                log.warning("node %s: %s observer failed: %s", node_id, event, exc)
            except Exception:
                log.exception("node %s: %s observer failed", node_id, event)

    # ------------------------------------------------------ SessionRegistry protocol

    def is_alive(self, node_id: str) -> bool:
        return node_id in self._sessions or (
            self.remote is not None and node_id in self.remote.alive_elsewhere())

    def elsewhere(self) -> AbstractSet[str]:
        if self.remote is None:
            return frozenset()
        return self.remote.alive_elsewhere() - self._sessions.keys()

    async def close(self, node_id: str, reason: CloseReason) -> None:
        session = self._sessions.get(node_id)
        if session is not None:
            await session.close(reason)
        elif self.remote is not None:
            await self.remote.close(node_id, reason)

    def push_overcommit(self, node_id: str) -> None:
        session = self._sessions.get(node_id)
        if session is not None:
            session.push_overcommit()

    async def call(self, node_id: str, args: Args, timeout: float) -> dict[str, object]:
        session = self._sessions.get(node_id)
        if session is None:
            if self.remote is not None:
                return await self.remote.call(node_id, args, timeout)
            raise Unavailable(f"node {node_id} has no live control session")
        return await session.call(args, timeout)

    # ------------------------------------------------------------------- others

    def live(self) -> list[NodeSession]:
        return list(self._sessions.values())

    def get(self, node_id: str) -> NodeSession | None:
        return self._sessions.get(node_id)

    async def close_all(self, reason: CloseReason) -> None:
        async with trio.open_nursery() as nursery:
            for session in self.live():
                nursery.start_soon(partial(session.close, reason, wait=2.0))

    async def serve_websocket(self, ws: WebSocket, auth: Authenticator) -> None:
        """The whole life of one node connection, from the upgrade to the last frame."""
        try:
            caller = await auth.verify(ws.headers.get("authorization"))
            if caller.kind != "node":
                raise PermissionDenied(
                    f"identity {caller.identity_id} is an operator identity: "
                    "the control session is for nodes")
        except (Unauthenticated, PermissionDenied) as exc:
            await _deny(ws, exc)
            return
        await ws.accept()
        hello = await self._receive_hello(ws)
        if hello is None:
            return
        session_id = ids.new_id("ses")
        verdict = await self.store.write(partial(
            ss.evaluate_hello, identity_id=caller.identity_id, hello=hello,
            session_id=session_id, now=self.now(), replica_id=self.replica_id))
        if not verdict.accepted:
            log.info("node %s incarnation %d rejected: %s (%s)", hello.node_id,
                     hello.incarnation, verdict.reason, verdict.message)
            await _reject(ws, verdict.reason or RejectReason.NOT_ADMITTED,
                          verdict.message or "")
            return
        session = NodeSession(self, ws, caller, hello, session_id)
        old = self._sessions.get(hello.node_id)
        self._sessions[hello.node_id] = session
        if old is not None:
            old.close_reason = old.close_reason or CloseReason.REPLACED
            with contextlib.suppress(Unavailable):
                old.send_nowait(Close(reason=CloseReason.REPLACED))
        log.info("node %s incarnation %d: session %s started%s", hello.node_id,
                 hello.incarnation, session_id,
                 " (isolate cleared)" if verdict.cleared_isolate else "")
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.run, Welcome(
                    session_id=session_id,
                    overcommit=Ratios(**verdict.overcommit) if verdict.overcommit else None,
                    drain_requested=verdict.drain_requested,
                    session_signing_public_key=self.session_signing_public_key))
                nursery.start_soon(self.notify, "session_started", hello.node_id, hello)
                # A revoke or retire that committed after the hello was decided but
                # before this session was registered would have found nothing to close.
                if not await self.store.run(partial(
                        ss.still_admitted, identity_id=caller.identity_id,
                        node_id=hello.node_id)):
                    nursery.start_soon(session.close, CloseReason.REVOKED)
        finally:
            if self._sessions.get(hello.node_id) is session:
                del self._sessions[hello.node_id]
            session.ended.set()
            with trio.CancelScope(shield=True):
                await self.store.write(partial(
                    ss.end_session, node_id=hello.node_id, session_id=session_id,
                    now=self.now()))
                with trio.move_on_after(5.0):
                    await self.notify("session_ended", hello.node_id)
                with trio.move_on_after(1.0):
                    await _close_quietly(ws)
            log.info("node %s: session %s ended (%s)", hello.node_id, session_id,
                     session.close_reason)

    async def _receive_hello(self, ws: WebSocket) -> Hello | None:
        try:
            with trio.fail_after(self.settings.session_timeout):
                text = await ws.receive_text()
            return parse(Hello, decode(text))
        except trio.TooSlowError:
            await _reject(ws, RejectReason.INVALID_HELLO, "no hello within the session timeout")
        except WebSocketDisconnect:
            pass
        except ProtocolError as exc:
            await _reject(ws, RejectReason.INVALID_HELLO, str(exc))
        return None


async def _deny(ws: WebSocket, exc: KibotosError) -> None:
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(JSONResponse(exc.to_wire(), status_code=exc.http_status))
    else:
        await ws.close(1008, exc.message[:100])


async def _reject(ws: WebSocket, reason: RejectReason, message: str) -> None:
    try:
        await ws.send_text(encode(Rejected(reason=reason, message=clip(message) or "")))
        await ws.close(1008, reason)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass


async def _close_quietly(ws: WebSocket) -> None:
    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        await ws.close(1000)
