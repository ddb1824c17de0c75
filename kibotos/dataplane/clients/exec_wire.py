"""The exec protocol's messages as the client sees them, without any I/O.

Both client ends share this: `kibotos.dataplane.clients.client` (trio and trio-websocket, for
tests and services that already run trio) and `kibotos.dataplane.clients.exec_blocking` (a
socket and `kibotos.dataplane.clients.ws_client`, for ``kibo workspace exec``, which must not
pay trio's import).
What a frame means is decided here once, so the two cannot drift.  The protocol is
described in `kibotos.dataplane.endpoints.exec_session` and docs/dataplane.md.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kibotos.core.errors import Internal, InvalidArgument, KibotosError, error_from_wire

EXEC_PATH = "/v1/exec"
STDIN, STDOUT, STDERR = 0, 1, 2
#: stdin is sent in frames of at most this many bytes.
STDIN_CHUNK = 64 * 1024
#: The largest message a client accepts (output frames are far smaller).
MAX_MESSAGE = 4 << 20
_STATUS_CODES = {401: "unauthenticated", 403: "permission_denied", 404: "not_found",
                 412: "failed_precondition", 502: "unavailable", 503: "unavailable"}


@dataclass(frozen=True)
class ExecRequest:
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    tty: bool = False
    rows: int = 24
    cols: int = 80
    #: A guest user name (`user_name.check_user_name`); None: the agent's default user.
    user: str | None = None


@dataclass(frozen=True)
class Started:
    pid: int


@dataclass(frozen=True)
class Output:
    stream: int  # 1 stdout, 2 stderr
    data: bytes


class Exited:
    """The ``exit`` frame: an exit code, or the signal that ended the process.  (Not the
    guest model's `ExitStatus`, which the trio client makes from it with `as_wire`:
    importing that model costs ``kibo workspace exec`` more than this whole module.)"""

    __slots__ = ("exit_code", "signal", "signal_name")

    def __init__(self, exit_code: int | None, signal: int | None = None,
                 signal_name: str | None = None) -> None:
        self.exit_code = exit_code
        self.signal = signal
        self.signal_name = signal_name

    @property
    def returncode(self) -> int:
        """The shell's convention: the exit code, or 128 + the signal number."""
        return self.exit_code if self.exit_code is not None else 128 + (self.signal or 0)

    def as_wire(self) -> dict[str, Any]:
        """The guest protocol's exit fields (`kibotos.guest.ExitStatus.from_wire`)."""
        return {"exit_code": self.exit_code, "signal": self.signal,
                "signal_name": self.signal_name}

    def __repr__(self) -> str:
        return (f"Exited(exit_code={self.exit_code!r}, signal={self.signal!r}, "
                f"signal_name={self.signal_name!r})")


Event = Started | Output | Exited


def exec_url(dataplane_url: str) -> str:
    """``http://host:port`` (what ctrl returns) → ``ws://host:port/v1/exec``."""
    parts = urllib.parse.urlsplit(dataplane_url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.hostname:
        raise InvalidArgument(f"data-plane URL {dataplane_url!r} must be http(s)://host:port")
    return str(urllib.parse.urlunsplit(
        (scheme, parts.netloc, parts.path.rstrip("/") + EXEC_PATH, "", "")))


def _json(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"))


def request_frame(request: ExecRequest) -> str:
    """The first frame after the upgrade (``user`` only when there is one, so a data
    plane older than it still takes every request that does not need it)."""
    body: dict[str, Any] = {"argv": list(request.argv), "env": request.env,
                            "cwd": request.cwd, "tty": request.tty, "rows": request.rows,
                            "cols": request.cols}
    if request.user is not None:
        body["user"] = request.user
    return _json(body)


def stdin_frames(data: bytes) -> Iterator[bytes]:
    view = memoryview(data)
    while view:
        chunk, view = view[:STDIN_CHUNK], view[STDIN_CHUNK:]
        yield bytes((STDIN,)) + bytes(chunk)


def eof_frame() -> str:
    return _json({"type": "eof"})


def resize_frame(rows: int, cols: int) -> str:
    return _json({"type": "resize", "rows": rows, "cols": cols})


def signal_frame(sig: str | int, group: bool = True) -> str:
    return _json({"type": "signal", "signal": sig, "group": group})


def decode(message: str | bytes) -> Event | None:
    """The event a server message stands for; None for a control message of a newer
    data plane (ignored).  An ``error`` frame is raised as the error it names."""
    if isinstance(message, bytes):
        if len(message) < 1 or message[0] not in (STDOUT, STDERR):
            raise Internal(f"the data plane sent a frame for stream {message[:1]!r}")
        return Output(message[0], message[1:])
    body = _parse(message)
    kind = body.get("type")
    if kind == "started":
        pid = body.get("pid")
        return Started(pid if isinstance(pid, int) else 0)
    if kind == "exit":
        code, sig, name = body.get("code"), body.get("signal"), body.get("signal_name")
        code = code if isinstance(code, int) and not isinstance(code, bool) else None
        sig = sig if isinstance(sig, int) and not isinstance(sig, bool) else None
        if code is None and sig is None:
            raise Internal(f"the data plane's exit frame has neither code nor signal: "
                           f"{body!r}")
        return Exited(code, sig, name if isinstance(name, str) else None)
    if kind == "error":
        raise error_from_wire({"error": body})
    return None


def _parse(message: str) -> dict[str, Any]:
    try:
        body = json.loads(message)
    except ValueError:
        raise Internal(f"the data plane sent a non-JSON text frame: {message[:80]!r}") from None
    if not isinstance(body, dict):
        raise Internal(f"the data plane sent {body!r}")
    return body


def rejection(status_code: int, body: bytes | None, url: str) -> KibotosError:
    """The error a refused upgrade stands for: the one its JSON body names, else one
    chosen by its status."""
    try:
        parsed = json.loads(body or b"")
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return error_from_wire(parsed)
    code = _STATUS_CODES.get(status_code, "internal")
    return error_from_wire({"error": {"code": code, "message": f"the data plane at {url} "
                                      f"refused the connection with HTTP {status_code}"}})
