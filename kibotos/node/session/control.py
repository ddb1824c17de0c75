"""The node's control session: one WebSocket to ctrl, held for the life of the process.

The protocol is the one in docs/architecture.md ("Node control session"): the node
says ``hello``, ctrl answers ``welcome`` or ``rejected``, then both sides talk until the
socket drops.  A dropped or unreachable ctrl is normal (ctrl restarts, networks blip),
so the node reconnects with exponential backoff and jitter; it keeps its incarnation
and gets a new session ID each time.  Refusals that retrying soon cannot fix (not
admitted, retired, revoked, a stale incarnation) are retried slowly, once a minute, so
an operator's fix is picked up without a restart.  ``rejected{isolated}`` is the one
ending: the node destroys every Instance and the process exits with status 75, so
systemd restarts it with a new incarnation, which clears the isolate.
"""

from __future__ import annotations

import logging
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
    wrap_client_stream,
)

from kibotos._version import SOURCE_REVISION, release_version
from kibotos.config import NodeConfig
from kibotos.core.errors import FailedPrecondition, Internal, InvalidArgument, KibotosError
from kibotos.core.logs import LOGGER_NAME, EventLogger
from kibotos.node.host.clock import NodeClock
from kibotos.node.host.usage import UsageSampler
from kibotos.node.instances.contract import InstanceManager
from kibotos.node.session.backoff import Backoff
from kibotos.node.session.ctrl_http import CtrlUrls
from kibotos.node.session.identity import NodeIdentity
from kibotos.node.session.report import ReportBoard
from kibotos.protocol import (
    Amount,
    ClockProbe,
    Close,
    CloseReason,
    Command,
    CommandError,
    CommandResult,
    Hello,
    Message,
    NetworkFacts,
    Overcommit,
    OvercommitAck,
    Ping,
    ProtocolError,
    Ratios,
    Rejected,
    RejectReason,
    Report,
    Usage,
    UsageRequest,
    Welcome,
    encode,
    json_text,
    parse,
)
from kibotos.protocol.values import MAX_ERROR_MESSAGE, printable_text
from kibotos.tls.contexts import verification_error

log = EventLogger()

SESSION_PATH = "/v1/node/session"
#: Exit status of a node told it was isolated (EX_TEMPFAIL: "try again", systemd restarts).
EXIT_ISOLATED = 75

CommandHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class NodeIsolated(FailedPrecondition):
    """ctrl refused this incarnation because the operator declared the node isolated."""

    exit_code: ClassVar[int] = EXIT_ISOLATED


class _Drop(Exception):
    """Ends one connection; `slow` picks the slow retry over the backoff."""

    def __init__(self, reason: str, *, slow: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.slow = slow


@dataclass(frozen=True)
class SessionTiming:
    """The session's clocks; tests shorten them, production keeps the defaults."""

    ping_interval: float = 5.0  # docs/architecture.md: node → ping every 5 s
    silence_timeout: float = 20.0  # nothing from ctrl this long: the socket is dead
    welcome_timeout: float = 30.0
    slow_retry: float = 60.0  # after a refusal that a quick retry cannot fix
    backoff_initial: float = 0.5
    backoff_cap: float = 10.0


DEFAULT_TIMING = SessionTiming()


@dataclass
class SessionStatus:
    """What the session looks like from outside (tests, logs, later `/metrics`)."""

    connected: bool = False
    session_id: str | None = None
    established: int = 0  # sessions established since start
    overcommit: dict[str, Any] | None = None  # last {cpu, memory, serial} from ctrl
    last_refusal: str | None = None

    def __post_init__(self) -> None:
        self._changed = trio.Event()

    def _touch(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[SessionStatus], bool]) -> None:
        while not predicate(self):
            await self._changed.wait()


def session_url(ctrl_url: str) -> str:
    """``http://h:p[/prefix]`` → ``ws://h:p[/prefix]/v1/node/session`` (https → wss)."""
    base = ctrl_url.rstrip("/")
    if base.startswith("https://"):
        base = "wss://" + base.removeprefix("https://")
    elif base.startswith("http://"):
        base = "ws://" + base.removeprefix("http://")
    else:
        raise InvalidArgument(f"node.ctrl_url must start with http:// or https://: {ctrl_url!r}")
    return base + SESSION_PATH


class ControlSession:
    """Holds the session; `run` returns only by raising `NodeIsolated`."""

    def __init__(
        self,
        config: NodeConfig,
        identity: NodeIdentity,
        incarnation: int,
        *,
        clock: NodeClock,
        sampler: UsageSampler,
        board: ReportBoard,
        instances: InstanceManager,
        on_established: Callable[[], None] | None = None,
        on_welcome: Callable[[Welcome], Awaitable[None]] | None = None,
        timing: SessionTiming = DEFAULT_TIMING,
        ssl_context: ssl.SSLContext | None = None,
        pools: Callable[[], list[dict[str, Any]]] | None = None,
        release: str | None = None,
    ) -> None:
        #: The release in hello (`BuildIdentity.reported_release`; default this build's).
        self.release = release or release_version()
        self.config = config
        self.identity = identity
        self.incarnation = incarnation
        self.clock = clock
        self.sampler = sampler
        self.board = board
        self.instances = instances
        self.on_established = on_established
        #: Awaited with every welcome before the node goes on (the data plane takes
        #: ``session_signing_public_key`` from it).
        self.on_welcome = on_welcome
        self.timing = timing
        self.backoff = Backoff(initial=timing.backoff_initial, cap=timing.backoff_cap)
        self.ssl_context = ssl_context
        #: ``[node] ctrl_url``'s replicas: a dropped session reconnects to the next.
        self.urls = CtrlUrls(config.node.ctrl_urls)
        session_url(self.urls.current)  # an unusable URL fails here, not at connect
        self.status = SessionStatus()
        self.commands: dict[str, CommandHandler] = {}
        #: ``facts.pools`` of hello and every report: the pool monitor's facts
        #: (`kibotos.node.storage.pools.availability.PoolMonitor.facts`); without one, the
        #: declared pools with no ``available`` flag.
        self.pools = pools

    @property
    def url(self) -> str:
        """The session URL of the ctrl replica this session uses (or tries) now."""
        return session_url(self.urls.current)

    # ------------------------------------------------------------------ outer loop

    async def run(self) -> NoReturn:
        while True:
            try:
                await self._connect_once()
                drop = _Drop("connection ended")
            except _Drop as exc:
                drop = exc
            except ConnectionRejected as exc:
                refused = exc.status_code in (401, 403)
                drop = _Drop(f"ctrl refused the upgrade with HTTP {exc.status_code}"
                             + (" (credential refused)" if refused else ""), slow=refused)
            except trio.TooSlowError:
                drop = _Drop(f"ctrl did not answer within {self.timing.welcome_timeout:g}s")
            except (HandshakeError, ConnectionClosed, OSError, trio.BrokenResourceError) as exc:
                drop = _Drop(f"{type(exc).__name__}: {exc}".rstrip(": "))
            except NodeIsolated:
                self._set_disconnected()
                raise
            except Exception as exc:  # a bug here must not leave the node without a session
                log.error("control session failed unexpectedly", error=repr(exc))
                logging.getLogger(LOGGER_NAME).debug("traceback", exc_info=True)
                drop = _Drop(f"internal error: {exc!r}")
            self._set_disconnected()
            # With several replicas the next attempt goes to the next one: this one
            # ended the session or could not hold one (down, stalled, shutting down).
            was = self.url
            self.urls.failed(self.urls.current)
            if drop.slow:
                delay = self.timing.slow_retry
                self.status.last_refusal = drop.reason
                self.status._touch()
            else:
                delay = self.backoff.next_delay()
            log.warning("control session down", reason=drop.reason, url=was,
                        retry_in=f"{delay:.1f}s",
                        **({"next_url": self.url} if self.url != was else {}))
            await trio.sleep(delay)

    def _set_disconnected(self) -> None:
        if self.status.connected:
            self.status.connected = False
            self.status._touch()

    # ------------------------------------------------------------------ one connection

    def hello(self) -> Hello:
        cfg = self.config
        return Hello(
            node_id=cfg.node.id,
            incarnation=self.incarnation,
            release_version=self.release,
            source_revision=SOURCE_REVISION,
            resources=Amount(cpu_millis=cfg.resources.cpu_millis,
                             memory_bytes=cfg.resources.memory_bytes),
            report=self.board.report(),
            dataplane_address=cfg.node.dataplane_address(),
            facts=self.facts(),
        )

    def facts(self) -> dict[str, Any]:
        """What hello and each report say about the node's pools (availability can
        change while the session lives, so ctrl must hear it with every report) and
        its network (``[network]``: placement puts a Workspace that needs public
        egress only on a node that provides it; absent = no network at all)."""
        if self.pools is not None:
            facts: dict[str, Any] = {"pools": self.pools()}
        else:
            facts = {"pools": [{"id": p.id, "shared": p.shared, "default": p.default}
                               for p in self.config.storage.pool]}
        network = self.config.network
        if network is not None:
            facts["network"] = NetworkFacts(
                public_egress=network.public_egress).model_dump(mode="json")
        return facts

    async def _connect_once(self) -> None:
        """One connection from TCP connect to close.  The node owns the TCP stream (not
        trio-websocket's `open_websocket_url`, whose client leaves the socket open when the
        server closes first), so the socket is closed on every way out."""
        try:
            async with trio.open_nursery() as nursery:
                await self._open_and_serve(nursery)
                nursery.cancel_scope.cancel()  # ends the websocket's reader task
        except BaseExceptionGroup as group:
            raise _first_cause(group) from None

    async def _open_and_serve(self, nursery: trio.Nursery) -> None:
        target = urllib.parse.urlsplit(self.url)
        host = target.hostname or ""
        tls = target.scheme == "wss"
        port = target.port or (443 if tls else 80)
        stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]
        with trio.fail_after(self.timing.welcome_timeout):
            if tls:
                stream = await trio.open_ssl_over_tcp_stream(
                    host, port, ssl_context=self.ssl_context or ssl.create_default_context(),
                    https_compatible=True)
            else:
                stream = await trio.open_tcp_stream(host, port)
        try:
            if isinstance(stream, trio.SSLStream):
                # Here, not inside trio-websocket, whose reader would swallow a
                # certificate that does not verify into a silent wait for the welcome.
                with trio.fail_after(self.timing.welcome_timeout):
                    try:
                        await stream.do_handshake()
                    except trio.BrokenResourceError as exc:
                        unverified = verification_error(exc)
                        if unverified is None:
                            raise
                        raise _Drop(f"ctrl's certificate does not verify against "
                                    f"node.ctrl_ca_file ({unverified.verify_message})",
                                    slow=True) from None  # a retry soon cannot fix it
            headers = [(b"Authorization", f"Bearer {self.identity.credential}".encode())]
            with trio.fail_after(self.timing.welcome_timeout):
                ws = await wrap_client_stream(
                    nursery, stream, host if port in (80, 443) else f"{host}:{port}",
                    target.path, extra_headers=headers)
            try:
                seen = self.board.version
                # hello carries every Instance's state: older frames are superseded.
                seen_states = self.instances.state_feed().position
                await _send(ws, self.hello())
                with trio.move_on_after(self.timing.welcome_timeout) as scope:
                    first = await _receive(ws)
                if scope.cancelled_caught:
                    raise _Drop(f"no answer to hello within {self.timing.welcome_timeout:g}s")
                await self._on_first(ws, first)
                await self._serve(ws, seen, seen_states)
            finally:
                # A polite close handshake when ctrl is still there; when the node itself
                # is being cancelled this returns at once and the stream is just closed.
                with trio.move_on_after(2.0):
                    await ws.aclose()
        finally:
            await trio.aclose_forcefully(stream)

    async def _on_first(self, ws: WebSocketConnection, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "rejected":
            try:
                rejected = parse(Rejected, msg)
            except ProtocolError as exc:
                log.error("ctrl rejected the session", error=str(exc),
                          incarnation=self.incarnation)
                raise _Drop(f"rejected: {exc}", slow=True) from None
            reason, message = rejected.reason, rejected.message
            if reason is RejectReason.ISOLATED:
                log.error("ctrl says this node was isolated: destroying all Instances and "
                          "exiting for a restart with a new incarnation",
                          incarnation=self.incarnation, message=message)
                await ws.aclose()
                destroyed = await self.instances.destroy_all()
                log.error("Instances destroyed after isolate", count=destroyed)
                raise NodeIsolated(f"node {self.config.node.id} was isolated at incarnation "
                                   f"{self.incarnation}: {message}")
            log.error("ctrl rejected the session", reason=reason.value, message=message,
                      incarnation=self.incarnation)
            raise _Drop(f"rejected: {reason.value}: {message}", slow=True)
        if kind != "welcome":
            raise _Drop(f"expected welcome or rejected, got {kind!r}")
        try:
            welcome = parse(Welcome, msg)
        except ProtocolError as exc:
            raise _Drop(str(exc)) from None
        self.backoff.reset()
        if self.on_established is not None:
            self.on_established()
        self.status.connected = True
        self.status.session_id = welcome.session_id
        self.status.established += 1
        self.status.last_refusal = None
        self.status._touch()
        log.info("control session established", session_id=welcome.session_id,
                 incarnation=self.incarnation, url=self.url)
        if welcome.drain_requested is not None:
            self.instances.set_drain_requested(welcome.drain_requested)
        if self.on_welcome is not None:
            await self.on_welcome(welcome)
        if welcome.overcommit is not None:
            await self._on_overcommit(ws, welcome.overcommit)

    async def _serve(self, ws: WebSocketConnection, seen: int, seen_states: int) -> None:
        """Receive, ping and report until one of them ends the connection."""
        self._last_heard = trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pinger, ws)
                nursery.start_soon(self._reporter, ws, seen)
                nursery.start_soon(self._state_sender, ws, seen_states)
                await self._receiver(ws, nursery)
        except BaseExceptionGroup as group:
            raise _first_cause(group) from None

    async def _receiver(self, ws: WebSocketConnection, nursery: trio.Nursery) -> None:
        while True:
            msg = await _receive(ws)
            self._last_heard = trio.current_time()
            kind = msg.get("type")
            if kind == "pong":
                continue
            if kind == "close":
                try:
                    reason = parse(Close, msg).reason.value
                except ProtocolError:
                    reason = str(msg.get("reason"))  # a reason of a newer ctrl
                log.warning("ctrl closed the session", reason=reason)
                raise _Drop(f"closed by ctrl: {reason}", slow=reason == CloseReason.REVOKED)
            model = _RECEIVED.get(kind) if isinstance(kind, str) else None
            if model is None:
                log.warning("ignoring unknown message from ctrl", type=kind)
                continue
            try:
                received = parse(model, msg)
            except ProtocolError as exc:
                await self._refuse(ws, msg, exc)
                continue
            if isinstance(received, ClockProbe):
                await _send(ws, self.clock.reply(received.id))
            elif isinstance(received, UsageRequest):
                await _send(ws, Usage(id=received.id,
                                      sample=self.sampler.current().to_wire()))
            elif isinstance(received, Overcommit):
                await self._on_overcommit(ws, received)
            elif isinstance(received, Command):
                nursery.start_soon(self._run_command, ws, received)

    async def _refuse(self, ws: WebSocketConnection, msg: dict[str, Any],
                      exc: ProtocolError) -> None:
        """A malformed frame from ctrl: a command whose ID can be answered gets
        `invalid_argument`; anything else is logged and ignored, the session stays."""
        request_id = msg.get("id")
        if msg.get("type") == "command" and type(request_id) is int and request_id >= 1:
            await _send(ws, CommandResult(id=request_id, ok=False, error=_error(
                InvalidArgument(str(exc)))))
        else:
            log.warning("ignoring malformed message from ctrl", error=str(exc))

    async def _on_overcommit(self, ws: WebSocketConnection, ratios: Ratios) -> None:
        self.status.overcommit = {"cpu": ratios.cpu, "memory": ratios.memory,
                                  "serial": ratios.serial}
        self.status._touch()
        log.info("overcommit ratios", cpu=ratios.cpu, memory=ratios.memory,
                 serial=ratios.serial)
        await _send(ws, OvercommitAck(serial=ratios.serial))

    async def _run_command(self, ws: WebSocketConnection, command: Command) -> None:
        kind = command.kind
        handler = self.commands.get(kind)
        try:
            if handler is None:
                raise InvalidArgument(f"unknown command kind {kind!r} for this node "
                                      f"(release {self.release})")
            reply = CommandResult(id=command.id, ok=True, result=await handler(command.args))
        except KibotosError as exc:
            reply = CommandResult(id=command.id, ok=False, error=_error(exc))
        except Exception as exc:  # a handler bug must not end the session
            log.error("command failed", id=command.id, kind=kind, error=repr(exc))
            reply = CommandResult(id=command.id, ok=False,
                                  error=_error(Internal(f"{kind}: {exc}")))
        await _send(ws, reply)

    async def _pinger(self, ws: WebSocketConnection) -> None:
        while True:
            await trio.sleep(self.timing.ping_interval)
            silent = trio.current_time() - self._last_heard
            if silent > self.timing.silence_timeout:
                await ws.aclose()
                raise _Drop(f"nothing heard from ctrl for {silent:.0f}s")
            await _send(ws, Ping())

    async def _reporter(self, ws: WebSocketConnection, seen: int) -> None:
        while True:
            seen = await self.board.wait_changed(seen)
            report = self.board.report()
            await _send(ws, Report.model_validate({**report.to_wire(),
                                                   "facts": self.facts()}))
            log.info("report sent", memory_tight=report.memory_tight,
                     instance_count=report.instance_count)


    async def _state_sender(self, ws: WebSocketConnection, seen: int) -> None:
        """``instance_state`` frames, in order, as the Instance manager publishes them."""
        feed = self.instances.state_feed()
        while True:
            seen, frames = await feed.after(seen)
            for frame in frames:
                await _send(ws, frame)


def _first_cause(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception worth handling out of a connection's task group: several tasks
    notice a dropped socket at once, and each says so."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        elif not isinstance(exc, trio.Cancelled):
            leaves.append(exc)

    walk(group)
    for preferred in (NodeIsolated, _Drop, ConnectionRejected, ConnectionClosed):
        for leaf in leaves:
            if isinstance(leaf, preferred):
                return leaf
    if len(leaves) == 1:
        return leaves[0]
    return group


#: What ctrl sends that the receiver parses (``pong`` and ``close`` it handles itself;
#: ``welcome``/``rejected`` come only first).
_RECEIVED: dict[str, type[Message]] = {
    cls.type_name(): cls for cls in (ClockProbe, UsageRequest, Overcommit, Command)}


def _error(exc: KibotosError) -> CommandError:
    """``command_result.error`` of `exc` (its message cut to the protocol's ceiling)."""
    return CommandError.model_validate({**exc.to_wire()["error"],
                                        "message": printable_text(exc.message,
                                                                   MAX_ERROR_MESSAGE)})


async def _send(ws: WebSocketConnection, msg: Message | dict[str, Any]) -> None:
    await ws.send_message(encode(msg))


async def _receive(ws: WebSocketConnection) -> dict[str, Any]:
    raw = await ws.get_message()
    try:
        msg = json_text.loads(raw)
    except json_text.JsonTextError:
        raise _Drop(f"malformed frame from ctrl: {raw[:80]!r}") from None
    if not isinstance(msg, dict):
        raise _Drop(f"malformed frame from ctrl: {raw[:80]!r}")
    return msg
