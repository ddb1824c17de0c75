"""The local control socket of a node-run process: the part both of them share.

The node talks to its data-plane process (`kibotos.dataplane.process.control`) and its egress
processes (`kibotos.egress.wire`) the same way: JSON lines over a unix stream socket
whose permissions say who may connect, each request one object with a string
``type``, each answer one line, ``{"ok": true, "result": {…}}`` or ``{"ok": false,
"error": {code, message}}``.  The egress wire adds descriptors beside a line; what the
two have in common is here: the socket path's limit, binding (replacing a stale socket
file, the file 0600), removing only one's own socket file, the answer envelope on the
serving side, and on the calling side the connect, the deadline and reading the
envelope back into a result or the error it carries.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import trio

from kibotos.core.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    KibotosError,
    Unavailable,
    error_from_wire,
)
from kibotos.core.logs import EventLogger

#: A request or answer line longer than this is refused.
MAX_LINE = 16 << 20
#: ``sun_path`` holds 108 bytes with its terminating NUL.
MAX_SOCKET_PATH = 107


def check_socket_path(path: Path) -> Path:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise InvalidArgument(f"unix socket path {path} is longer than {MAX_SOCKET_PATH} "
                              "bytes: choose a shorter node.socket_dir")
    return path


def bind(path: Path, *, backlog: int) -> socket.socket:
    """A fresh socket listening at `path` (mode 0600), replacing a stale socket file left
    by a process that is gone (or by an older generation, which keeps its own open
    socket)."""
    check_socket_path(path)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            sock.bind(os.fspath(path))
        finally:
            os.umask(old)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise Unavailable(f"cannot listen on control socket {path}: {exc.strerror}") from None
    return sock


def remove_if_ours(path: Path, inode: int) -> None:
    """Remove the socket file at `path` unless another process bound the path since."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            path.unlink()


async def answer(handle: Callable[[], Awaitable[dict[str, Any]]], log: EventLogger,
                 request_type: object) -> dict[str, Any]:
    """The answer line of one request: its result, or the error it raised; a bug in one
    request is an ``internal`` answer, never the end of the control socket."""
    try:
        if not isinstance(request_type, str):
            raise InvalidArgument("control request must be an object with a string 'type'")
        return {"ok": True, "result": await handle()}
    except KibotosError as exc:
        return {"ok": False, **exc.to_wire()}
    except Exception as exc:
        log.error("control request failed", type=request_type, error=repr(exc))
        return {"ok": False, **Internal(f"control request failed: {exc!r}").to_wire()}


async def connect(path: Path, who: str) -> trio.socket.SocketType:
    """A connection to the process serving `path`; no one listening is `Unavailable`."""
    check_socket_path(path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.connect(os.fspath(path))
    except OSError as exc:
        sock.close()
        raise Unavailable(f"no {who} answers on {path}: {exc.strerror or exc}") from None
    return sock


@contextlib.contextmanager
def deadline(path: Path, who: str, request_type: object, timeout: float) -> Iterator[None]:
    """One call's deadline: no answer within `timeout` seconds is `DeadlineExceeded`,
    and a broken connection `Unavailable`."""
    try:
        with trio.fail_after(timeout):
            try:
                yield
            except (trio.BrokenResourceError, OSError) as exc:
                raise Unavailable(f"{who} control socket {path}: {exc}") from None
    except trio.TooSlowError:
        raise DeadlineExceeded(f"the {who} on {path} did not answer {request_type!r} "
                               f"within {timeout:g}s") from None


def result_of(answer: object, path: Path, who: str) -> dict[str, Any]:
    """The result an answer line carries, or the error it reports."""
    if answer is None:
        raise Unavailable(f"the {who} on {path} closed the connection without answering")
    if not isinstance(answer, dict):
        raise Internal(f"the {who} on {path} answered {answer!r}")
    result = answer.get("result")
    if answer.get("ok") is True and isinstance(result, dict):
        return dict(result)
    if answer.get("ok") is False:
        raise error_from_wire(answer)
    raise Internal(f"the {who} on {path} answered {answer!r}")
