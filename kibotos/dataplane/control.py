"""The data plane's local control socket: JSON lines over a unix socket, both ends.

``<socket_dir>/dataplane/control.sock`` (directory 0700, socket 0600, root only) is how
the node talks to its data-plane process: each request is one JSON object on one line,
each answer one line, ``{"ok": true, "result": {…}}`` or ``{"ok": false, "error":
{code, message}}``.  Requests (`kibotos.dataplane.serve` answers them):

* ``{"type": "state", generation, node_id, public_key, targets}`` → ``{generation,
  version, targets}``: the whole state, replaced at once (`kibotos.dataplane.state`);
* ``{"type": "status"}`` → ``{generation, build, listen, pid, version, has_state,
  connections, draining}``: what the node compares when it adopts a running process;
* ``{"type": "metrics"}`` → ``{text}``: the Prometheus text of this process's counters.

A connection may carry several requests.  The socket's permissions are the
authentication: only root (the node) can connect.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from kibotos.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    KibotosError,
    Unavailable,
    error_from_wire,
)
from kibotos.logs import EventLogger

log = EventLogger("kibotos.dataplane")

CONTROL_SOCKET = "control.sock"
MAX_LINE = 16 << 20
MAX_SOCKET_PATH = 107

ControlHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def dataplane_dir(socket_dir: Path) -> Path:
    """The data plane's own directory inside the node's socket directory."""
    return socket_dir / "dataplane"


def control_path(socket_dir: Path) -> Path:
    return dataplane_dir(socket_dir) / CONTROL_SOCKET


def check_socket_path(path: Path) -> Path:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise InvalidArgument(f"unix socket path {path} is longer than {MAX_SOCKET_PATH} "
                              "bytes: choose a shorter node.socket_dir")
    return path


async def _read_line(stream: trio.abc.ReceiveStream, buffer: bytearray) -> bytes | None:
    """One line without its newline; None at a clean EOF between lines."""
    while True:
        end = buffer.find(b"\n")
        if end >= 0:
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            return line
        if len(buffer) > MAX_LINE:
            raise InvalidArgument(f"control request longer than {MAX_LINE} bytes")
        data = await stream.receive_some(65536)
        if not data:
            if buffer:
                raise InvalidArgument("control connection closed in the middle of a line")
            return None
        buffer += data


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def _bind(path: Path) -> socket.socket:
    """Bind a fresh socket at `path`, replacing a stale socket file left by a process
    that is gone (or by the previous generation, which keeps its own open socket)."""
    check_socket_path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
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
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise Unavailable(f"cannot listen on control socket {path}: {exc.strerror}") from None
    return sock


async def serve_control(path: Path, handle: ControlHandler, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer requests on `path` until cancelled; the socket file is removed on the way
    out, unless another process has bound the path since."""
    sock = _bind(path)
    inode = os.stat(path).st_ino
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))

    async def connection(stream: trio.SocketStream) -> None:
        buffer = bytearray()
        try:
            while True:
                try:
                    line = await _read_line(stream, buffer)
                except InvalidArgument as exc:
                    await stream.send_all(_encode({"ok": False, **exc.to_wire()}))
                    return
                if line is None:
                    return
                await stream.send_all(_encode(await _answer(line, handle)))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, connection, [listener])
            task_status.started()
    finally:
        _remove_if_ours(path, inode)


def _remove_if_ours(path: Path, inode: int) -> None:
    """A newer generation may have bound the path meanwhile: leave its socket alone."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            path.unlink()


async def _answer(line: bytes, handle: ControlHandler) -> dict[str, Any]:
    try:
        try:
            message = json.loads(line)
        except ValueError as exc:
            raise InvalidArgument(f"control request is not JSON: {exc}") from None
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise InvalidArgument("control request must be an object with a string 'type'")
        return {"ok": True, "result": await handle(message)}
    except KibotosError as exc:
        return {"ok": False, **exc.to_wire()}
    except Exception as exc:  # a bug in one request must not end the control socket
        log.error("control request failed", error=repr(exc))
        return {"ok": False, **Internal(f"control request failed: {exc!r}").to_wire()}


async def control_call(path: Path, message: dict[str, Any], *,
                       timeout: float = 5.0) -> dict[str, Any]:
    """Send one request to the data plane at `path`; its result, or the error it sent.

    No process listening (file missing, connection refused) is `Unavailable`, no answer
    within `timeout` seconds `DeadlineExceeded`.
    """
    check_socket_path(path)
    try:
        with trio.fail_after(timeout):
            try:
                stream = await trio.open_unix_socket(os.fspath(path))
            except OSError as exc:
                raise Unavailable(f"no data-plane process answers on {path}: "
                                  f"{exc.strerror or exc}") from None
            async with stream:
                try:
                    await stream.send_all(_encode(message))
                    line = await _read_line(stream, bytearray())
                except (trio.BrokenResourceError, OSError) as exc:
                    raise Unavailable(f"data-plane control socket {path}: {exc}") from None
    except trio.TooSlowError:
        raise DeadlineExceeded(f"the data-plane process on {path} did not answer "
                               f"{message.get('type')!r} within {timeout:g}s") from None
    if line is None:
        raise Unavailable(f"the data-plane process on {path} closed the connection "
                          "without answering")
    try:
        answer = json.loads(line)
    except ValueError:
        raise Internal(f"the data-plane process on {path} answered with non-JSON: "
                       f"{line[:80]!r}") from None
    if not isinstance(answer, dict):
        raise Internal(f"the data-plane process on {path} answered {answer!r}")
    if answer.get("ok") is True and isinstance(answer.get("result"), dict):
        return dict(answer["result"])
    raise error_from_wire(answer)
