"""One exec over one WebSocket: the request frame, the streams, control, the exit.

The protocol (docs/dataplane.md, docs/architecture.md "Session credentials, data plane,
exec"), after the upgrade was authenticated:

* client → first text frame ``{argv, env?, cwd?, tty?, rows?, cols?, user?}``;
* server → ``{"type": "started", "pid"}`` once the guest started the process, or
  ``{"type": "error", "code", "message"}`` and a close when it could not;
* binary frames carry stream bytes behind one stream byte: 0 stdin (client → server),
  1 stdout and 2 stderr (server → client; a tty has only 1);
* client → text ``{"type": "resize", "rows", "cols"}``, ``{"type": "signal", "signal",
  "group"?}`` (name like ``"INT"`` or number; to the process group unless ``group`` is
  false) and ``{"type": "eof"}`` (end of stdin);
* server → ``{"type": "exit", "code"}`` or ``{"type": "exit", "signal", "signal_name"}``
  after both output streams ended, then a normal close (1000).

Flow control is end to end: output is read from the guest only as fast as the
WebSocket takes it, and stdin is sent to the guest only as its credit allows, so a slow
side stalls the process instead of filling memory.  A client that goes away before the
process exits hangs it up (``SIGHUP`` to its process group), as a terminal would.
"""

from __future__ import annotations

import json
import re
from typing import Any

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from kibotos.core.credentials import SessionClaims
from kibotos.core.errors import InvalidArgument, KibotosError, Unavailable
from kibotos.core.logs import EventLogger
from kibotos.dataplane.clients.exec_wire import STDERR, STDIN, STDOUT
from kibotos.dataplane.clients.exec_wire import ExecRequest as ExecRequest  # the gateway's seam
from kibotos.dataplane.clients.user_name import optional_user_name
from kibotos.dataplane.endpoints.relay import Relay, control_message
from kibotos.dataplane.process.metrics import DataplaneMetrics
from kibotos.guest import ExitStatus, GuestChannel, GuestOutputStream, GuestProcess

log = EventLogger("kibotos.dataplane")

#: How long a client has to send its request frame after the upgrade.
REQUEST_TIMEOUT = 30.0
#: How long the guest may take to start the process (a stuck guest must not hold the
#: connection forever; a process it starts later is killed by the guest client).
START_TIMEOUT = 30.0
#: WebSocket close codes: normal, going away (the data plane stops), protocol error,
#: server-side failure.
CLOSE_NORMAL, CLOSE_GOING_AWAY, CLOSE_PROTOCOL, CLOSE_SERVER_ERROR = 1000, 1001, 1008, 1011
_SIGNAL = re.compile(r"(SIG)?[A-Z][A-Z0-9+]{0,15}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_MAX_ARGV = 4096
_MAX_TEXT = 1 << 16


def _size(body: dict[str, Any], key: str, default: int) -> int:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise InvalidArgument(f"exec: {key} must be an integer from 1 to 65535, not {value!r}")
    return value


def parse_request(text: str) -> ExecRequest:
    """The first frame; every problem is `InvalidArgument` naming the field."""
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"exec: the request frame is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("exec: the request frame must be a JSON object")
    unknown = sorted(set(body) - {"argv", "env", "cwd", "tty", "rows", "cols", "user"})
    if unknown:
        raise InvalidArgument(f"exec: unknown fields {unknown}")
    argv = body.get("argv")
    if (not isinstance(argv, list) or not argv or len(argv) > _MAX_ARGV
            or not all(isinstance(a, str) and "\0" not in a for a in argv)):
        raise InvalidArgument("exec: argv must be a non-empty list of strings without NUL")
    env = body.get("env") or {}
    if not isinstance(env, dict):
        raise InvalidArgument("exec: env must be an object of strings")
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):
            raise InvalidArgument(f"exec: env name {name!r} is not a valid variable name")
        if not isinstance(value, str) or "\0" in value:
            raise InvalidArgument(f"exec: env {name} must be a string without NUL")
    cwd = body.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
        raise InvalidArgument("exec: cwd must be an absolute path")
    tty = body.get("tty", False)
    if not isinstance(tty, bool):
        raise InvalidArgument("exec: tty must be true or false")
    return ExecRequest(tuple(argv), dict(env), cwd, tty, _size(body, "rows", 24),
                       _size(body, "cols", 80),
                       optional_user_name(body.get("user"), "exec: user"))


def exit_frame(status: ExitStatus) -> dict[str, Any]:
    if status.exit_code is not None:
        return {"type": "exit", "code": status.exit_code}
    return {"type": "exit", "signal": status.signal, "signal_name": status.signal_name}


def error_frame(exc: KibotosError) -> dict[str, Any]:
    return {"type": "error", "code": exc.code, "message": exc.message}


class ExecSession(Relay):
    """Relays one process; `run` returns when it is over, whichever way."""

    def __init__(self, ws: WebSocketConnection, channel: GuestChannel, claims: SessionClaims,
                 metrics: DataplaneMetrics, *, request_timeout: float = REQUEST_TIMEOUT) -> None:
        super().__init__(ws)
        self.channel = channel
        self.claims = claims
        self.metrics = metrics
        self.request_timeout = request_timeout
        self.proc: GuestProcess | None = None
        self._stdin_tx, self._stdin_rx = trio.open_memory_channel[bytes | None](16)

    # -------------------------------------------------------------- lifecycle

    async def run(self) -> None:
        try:
            with trio.fail_after(self.request_timeout):
                first = await self.ws.get_message()
            if not isinstance(first, str):
                raise InvalidArgument("exec: the first frame must be the JSON request (text)")
            request = parse_request(first)
        except trio.TooSlowError:
            await self._refuse(InvalidArgument(
                f"exec: no request frame within {self.request_timeout:g}s"), CLOSE_PROTOCOL)
            return
        except ConnectionClosed:
            return
        except InvalidArgument as exc:
            self.metrics.exec_failed.labels(exc.code).inc()
            await self._refuse(exc, CLOSE_PROTOCOL)
            return
        try:
            with trio.move_on_after(START_TIMEOUT) as start:
                self.proc = await self.channel.exec(
                    list(request.argv), env=request.env, cwd=request.cwd, tty=request.tty,
                    rows=request.rows, cols=request.cols, user=request.user)
            if start.cancelled_caught:
                raise Unavailable(f"the guest of Instance {self.claims.instance_id} did not "
                                  f"start the process within {START_TIMEOUT:g}s")
        except KibotosError as exc:
            self.metrics.exec_failed.labels(exc.code).inc()
            await self._refuse(exc, CLOSE_SERVER_ERROR if exc.retryable or
                               exc.http_status >= 500 else CLOSE_PROTOCOL)
            return
        assert self.proc is not None
        self.metrics.exec_started.inc()
        log.info("exec started", instance_id=self.claims.instance_id, pid=self.proc.pid,
                 argv0=request.argv[0], tty=request.tty, user=request.user,
                 credential=self.claims.jti)
        await self._relay(self.proc)

    def shut_down(self) -> None:
        """The data plane is stopping: end this session now (its drain time is over)."""
        self._finish("stopping")

    async def _relay(self, proc: GuestProcess) -> None:
        with trio.CancelScope() as scope:
            self._scope = scope
            if self._outcome is None:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._reader, proc)
                    nursery.start_soon(self._stdin_writer, proc)
                    await self._watch(proc)
                    nursery.cancel_scope.cancel()
        await self._conclude(proc)

    async def _watch(self, proc: GuestProcess) -> None:
        """Announce the start, relay output to its end, then report the exit."""
        try:
            await self._send_json({"type": "started", "pid": proc.pid})
            async with trio.open_nursery() as outputs:
                for stream, sid in ((proc.stdout, STDOUT), (proc.stderr, STDERR)):
                    if stream is not None:
                        outputs.start_soon(self._pump, stream, sid)
            status = await proc.wait()
            await self._send_json(exit_frame(status))
            self._finish("exited")
        except ConnectionClosed:
            self._finish("client_gone")
        except KibotosError as exc:  # the guest channel failed under us
            self._finish("guest_failed", exc)

    async def _conclude(self, proc: GuestProcess) -> None:
        outcome = self._outcome or "client_gone"
        if outcome == "exited":
            await self._close(CLOSE_NORMAL, "process exited")
            return
        if outcome != "guest_failed":
            await self._hang_up(proc)
        if outcome == "client_gone":
            self.metrics.hung_up.inc()
            log.info("exec client went away; process hung up",
                     instance_id=self.claims.instance_id, pid=proc.pid)
        elif outcome == "protocol":
            assert self._error is not None
            await self._refuse(self._error, CLOSE_PROTOCOL)
        elif outcome == "guest_failed":
            error = self._error or Unavailable("the guest channel ended")
            log.warning("exec lost its guest", instance_id=self.claims.instance_id,
                        pid=proc.pid, error=error.message)
            await self._refuse(Unavailable(f"the guest of Instance {self.claims.instance_id}"
                                           f" went away: {error.message}"), CLOSE_SERVER_ERROR)
        elif outcome == "stopping":
            await self._close(CLOSE_GOING_AWAY, "data plane stopping")

    # -------------------------------------------------------------- the tasks

    async def _pump(self, stream: GuestOutputStream, sid: int) -> None:
        label = "stdout" if sid == STDOUT else "stderr"
        try:
            async for chunk in stream:
                await self.ws.send_message(bytes((sid,)) + chunk)
                self.metrics.bytes.labels(label).inc(len(chunk))
        except ConnectionClosed:
            self._finish("client_gone")
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            cause = exc.__cause__
            self._finish("guest_failed", cause if isinstance(cause, KibotosError) else
                         Unavailable(str(exc)))

    async def _reader(self, proc: GuestProcess) -> None:
        while True:
            message = await self._client_message()
            if message is None:
                return
            try:
                await self._on_message(proc, message)
            except InvalidArgument as exc:
                self._finish("protocol", exc)
                return

    async def _on_message(self, proc: GuestProcess, message: str | bytes) -> None:
        if isinstance(message, bytes):
            if not message or message[0] != STDIN:
                raise InvalidArgument("exec: a binary frame from the client must start with "
                                      "stream byte 0 (stdin)")
            if len(message) > 1:
                self.metrics.bytes.labels("stdin").inc(len(message) - 1)
                await self._stdin_tx.send(message[1:])
            return
        body = control_message(message, _MAX_TEXT, "exec")
        kind = body.get("type") if isinstance(body, dict) else None
        if kind == "eof":
            await self._stdin_tx.send(None)
        elif kind == "resize":
            rows, cols = _size(body, "rows", 24), _size(body, "cols", 80)
            await self._quietly(proc.resize(rows, cols), "resize")
        elif kind == "signal":
            sig = body.get("signal")
            if not ((isinstance(sig, int) and not isinstance(sig, bool) and 1 <= sig <= 64)
                    or (isinstance(sig, str) and _SIGNAL.fullmatch(sig))):
                raise InvalidArgument(f"exec: signal {sig!r} is not a signal name or number")
            group = body.get("group", True)
            if not isinstance(group, bool):
                raise InvalidArgument("exec: signal.group must be true or false")
            await self._quietly(proc.signal(sig, group=group), f"signal {sig}")
        else:
            raise InvalidArgument(f"exec: unknown control message type {kind!r}")

    async def _stdin_writer(self, proc: GuestProcess) -> None:
        """Feeds stdin at the guest's pace; after EOF or a closed stdin, later data is
        dropped (the process is not reading any more)."""
        stdin = proc.stdin
        async for data in self._stdin_rx:
            if stdin is None:
                continue
            try:
                if data is None:
                    await stdin.aclose()
                    stdin = None
                else:
                    await stdin.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                stdin = None

    # -------------------------------------------------------------- helpers

    async def _quietly(self, call: Any, what: str) -> None:
        """Resize and signal race with the process's exit; their failure is not the
        session's."""
        try:
            await call
        except KibotosError as exc:
            log.debug("exec control failed", what=what, error=exc.message)

    async def _hang_up(self, proc: GuestProcess) -> None:
        with trio.move_on_after(2.0, shield=True):
            if proc.exit_status is None:
                await self._quietly(proc.signal("HUP", group=True), "hangup")
            for stream in (proc.stdout, proc.stderr, proc.stdin):
                if stream is not None:
                    await stream.aclose()

    async def _send_json(self, message: dict[str, Any]) -> None:
        await self.ws.send_message(json.dumps(message, separators=(",", ":")))

    async def _refuse(self, exc: KibotosError, code: int) -> None:
        with trio.move_on_after(2.0, shield=True):
            try:
                await self._send_json(error_frame(exc))
            except ConnectionClosed:
                return
            await self.ws.aclose(code, exc.message[:120])

    async def _close(self, code: int, reason: str) -> None:
        with trio.move_on_after(2.0, shield=True):
            await self.ws.aclose(code, reason)
