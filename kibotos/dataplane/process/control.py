"""The data plane's local control socket: JSON lines over a unix socket, both ends.

``<socket_dir>/dataplane/control.sock`` (directory 0700, socket 0600, root only) is how
the node talks to its data-plane process: each request is one JSON object on one line,
each answer one line, ``{"ok": true, "result": {…}}`` or ``{"ok": false, "error":
{code, message}}``.  Requests (`kibotos.dataplane.process.serve` answers them):

* ``{"type": "state", generation, node_id, public_key, targets}`` → ``{generation,
  version, targets}``: the whole state, replaced at once (`kibotos.dataplane.process.state`);
* ``{"type": "status"}`` → ``{generation, build, listen, pid, version, has_state,
  connections, draining, tls, certificate_serial, certificate_not_after}``: what the
  node compares when it adopts a running process, and whether it has its certificate;
* ``{"type": "certificate", certificate, key}`` (PEM) → the new ``tls`` fields: the
  TLS listener's certificate for new handshakes (`kibotos.dataplane.process.tls_listener`);
* ``{"type": "metrics"}`` → ``{text}``: the Prometheus text of this process's counters.

A connection may carry several requests.  The socket's permissions are the
authentication: only root (the node) can connect.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from kibotos import control_socket
from kibotos.control_socket import MAX_LINE, MAX_SOCKET_PATH, check_socket_path
from kibotos.core.errors import Internal, InvalidArgument
from kibotos.core.logs import EventLogger

log = EventLogger("kibotos.dataplane")

CONTROL_SOCKET = "control.sock"
WHO = "data-plane process"
__all__ = ["MAX_LINE", "MAX_SOCKET_PATH", "check_socket_path", "control_call",
           "control_path", "dataplane_dir", "serve_control"]

ControlHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def dataplane_dir(socket_dir: Path) -> Path:
    """The data plane's own directory inside the node's socket directory."""
    return socket_dir / "dataplane"


def control_path(socket_dir: Path) -> Path:
    return dataplane_dir(socket_dir) / CONTROL_SOCKET


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


async def serve_control(path: Path, handle: ControlHandler, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer requests on `path` until cancelled; the socket file is removed on the way
    out, unless another process has bound the path since."""
    check_socket_path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock = control_socket.bind(path, backlog=64)
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
        control_socket.remove_if_ours(path, inode)


async def _answer(line: bytes, handle: ControlHandler) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError as exc:
        return {"ok": False,
                **InvalidArgument(f"control request is not JSON: {exc}").to_wire()}
    if not isinstance(message, dict):
        message = {"type": None}
    return await control_socket.answer(lambda: handle(message), log, message.get("type"))


async def control_call(path: Path, message: dict[str, Any], *,
                       timeout: float = 5.0) -> dict[str, Any]:
    """Send one request to the data plane at `path`; its result, or the error it sent.

    No process listening (file missing, connection refused) is `Unavailable`, no answer
    within `timeout` seconds `DeadlineExceeded`.
    """
    with control_socket.deadline(path, WHO, message.get("type"), timeout):
        stream = trio.SocketStream(await control_socket.connect(path, WHO))
        async with stream:
            await stream.send_all(_encode(message))
            line = await _read_line(stream, bytearray())
    if line is None:
        return control_socket.result_of(None, path, WHO)
    try:
        answer = json.loads(line)
    except ValueError:
        raise Internal(f"the {WHO} on {path} answered with non-JSON: {line[:80]!r}") \
            from None
    return control_socket.result_of(answer, path, WHO)
