"""The egress process's control socket: JSON lines over a unix stream socket, with file
descriptors (SCM_RIGHTS) beside a line, in both directions.

``<socket dir>-egress/control-<generation>.sock`` (the directory 0700 and owned by
``kibotos-egress``, the socket 0600; one per generation, so the node reaches a draining
generation beside the newest) is where the node talks to its egress process, as
it talks to its data-plane process (`kibotos.dataplane.control`): each request is one
JSON object on one line, each answer one line, ``{"ok": true, "result": {…}}`` or
``{"ok": false, "error": {code, message}}``.  What is new here are descriptors: a line
that carries some says how many in its ``"fds"`` field, and they travel in the same
``sendmsg`` as the line's first bytes.  Linux never lets one read span two messages
that carry descriptors, so the receiver gets a line's descriptors no later than the
line itself, in order, and pairs them by count.

Who may talk: besides the directory's permissions, the process checks each connecting
peer's credentials (``SO_PEERCRED``): root (the node) or its own user (a test that
runs everything as one user).  The process serves; the node calls (`call`).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from kibotos import control_socket
from kibotos.control_socket import MAX_LINE, check_socket_path
from kibotos.errors import (
    InvalidArgument,
    KibotosError,
    PermissionDenied,
)
from kibotos.logs import EventLogger

log = EventLogger("kibotos.egress")

CONTROL_SOCKET = "control-{generation}.sock"
SOCKET_DIR_SUFFIX = "-egress"
WHO = "egress process"
#: Descriptors in one line at most (the kernel's SCM_MAX_FD is 253).
MAX_FDS = 64
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * 4)


@dataclass
class Message:
    """One line and the descriptors that came with it (the receiver owns them)."""

    body: dict[str, Any]
    fds: list[int] = field(default_factory=list)

    def close_fds(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


Handler = Callable[[Message], Awaitable[Message]]


def socket_dir_of(node_socket_dir: Path) -> Path:
    """The egress process's directory, beside the node's socket directory."""
    node_socket_dir = Path(os.path.abspath(node_socket_dir))
    return node_socket_dir.with_name(node_socket_dir.name + SOCKET_DIR_SUFFIX)


def control_path(egress_dir: Path, generation: int) -> Path:
    return check_socket_path(egress_dir / CONTROL_SOCKET.format(generation=generation))


class Channel:
    """Both ends of one control connection: lines out with descriptors, lines in."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self._buffer = bytearray()
        self._fds: list[int] = []

    async def send(self, body: dict[str, Any], fds: Sequence[int] = ()) -> None:
        if len(fds) > MAX_FDS:
            raise InvalidArgument(f"{len(fds)} descriptors in one control line (at most "
                                  f"{MAX_FDS})")
        data = json.dumps({**body, "fds": len(fds)}, separators=(",", ":")).encode() + b"\n"
        sent = 0
        if fds:
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            sent = await self.sock.sendmsg([data], ancillary)
        while sent < len(data):
            sent += await self.sock.send(data[sent:])

    async def receive(self) -> Message | None:
        """The next line with its descriptors; None at a clean end between lines."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return self._parse(line)
            if len(self._buffer) > MAX_LINE:
                raise InvalidArgument(f"control line longer than {MAX_LINE} bytes")
            data, ancillary, flags, _ = await self.sock.recvmsg(
                65536, _ANCILLARY, socket.MSG_CMSG_CLOEXEC)
            self._fds += _descriptors(ancillary)
            if flags & socket.MSG_CTRUNC:
                self.close()
                raise InvalidArgument(f"more than {MAX_FDS} descriptors in one control line")
            if not data:
                if self._buffer:
                    raise InvalidArgument("control connection closed in the middle of a line")
                return None
            self._buffer += data

    def _parse(self, line: bytes) -> Message:
        try:
            body = json.loads(line)
        except ValueError as exc:
            raise InvalidArgument(f"control line is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidArgument("a control line must be a JSON object")
        count = body.pop("fds", 0)
        if not isinstance(count, int) or isinstance(count, bool) or not \
                0 <= count <= len(self._fds):
            raise InvalidArgument(f"control line announces {count!r} descriptors, "
                                  f"{len(self._fds)} arrived")
        fds, self._fds = self._fds[:count], self._fds[count:]
        return Message(body, fds)

    def close(self) -> None:
        """Close the descriptors received and not yet handed out (the socket is the
        caller's)."""
        Message({}, self._fds).close_fds()
        self._fds = []


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds += array.array("i", data[:usable]).tolist()
    return fds


def peer_uid(sock: trio.socket.SocketType) -> int:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", raw)
    return int(uid)


# ---------------------------------------------------------------------------- serving


async def serve(path: Path, handle: Handler, *,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer requests on `path` until cancelled; the socket file goes on the way out
    unless another process has bound the path since."""
    listener = trio.socket.from_stdlib_socket(control_socket.bind(path, backlog=16))
    inode = os.stat(path).st_ino
    allowed = {0, os.geteuid()}
    try:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                conn, _ = await listener.accept()
                nursery.start_soon(_connection, conn, handle, allowed)
    finally:
        listener.close()
        control_socket.remove_if_ours(path, inode)


async def _connection(conn: trio.socket.SocketType, handle: Handler, allowed: set[int]
                      ) -> None:
    channel = Channel(conn)
    with conn:
        try:
            uid = peer_uid(conn)
            if uid not in allowed:
                log.warning("control connection refused", peer_uid=uid)
                await channel.send({"ok": False, **PermissionDenied(
                    "only the node (root) talks to the egress process").to_wire()})
                return
            while True:
                try:
                    message = await channel.receive()
                except InvalidArgument as exc:
                    await channel.send({"ok": False, **exc.to_wire()})
                    return
                if message is None:
                    return
                answer = await _answer(message, handle)
                try:
                    await channel.send(answer.body, answer.fds)
                finally:
                    answer.close_fds()  # sent (the peer has its own copies) or not
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            channel.close()


async def _answer(message: Message, handle: Handler) -> Message:
    """The whole answer line (``ok`` and ``result`` or ``error``) and its descriptors."""
    fds: list[int] = []

    async def run() -> dict[str, Any]:
        result = await handle(message)
        fds[:] = result.fds
        return result.body

    try:
        return Message(await control_socket.answer(run, log, message.body.get("type")), fds)
    finally:
        message.close_fds()  # whatever the handler did not take (it sets .fds = [])


# ---------------------------------------------------------------------------- calling


async def call(path: Path, body: dict[str, Any], fds: Sequence[int] = (), *,
               timeout: float = 5.0) -> Message:
    """One request to the egress process at `path`; its result with the descriptors it
    sent (the caller owns them), or the error it answered.

    No process listening is `Unavailable`, no answer within `timeout` seconds
    `DeadlineExceeded`.
    """
    with control_socket.deadline(path, WHO, body.get("type"), timeout):
        sock = await control_socket.connect(path, WHO)
        with sock:
            channel = Channel(sock)
            try:
                await channel.send(body, fds)
                answer = await channel.receive()
            finally:
                channel.close()
    try:
        result = control_socket.result_of(None if answer is None else answer.body, path,
                                          WHO)
    except KibotosError:
        if answer is not None:
            answer.close_fds()
        raise
    assert answer is not None
    return Message(result, answer.fds)
