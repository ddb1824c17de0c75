"""A control socket that carries file descriptors (SCM_RIGHTS) beside its JSON lines.

The node's egress process takes its listening sockets this way (`kibotos.egress.wire`),
and a data-plane generation hands its listening socket to the next one
(`kibotos.dataplane.process.listen_handover`): the same line protocol as every control socket
of a node-run process (`kibotos.control_socket`), plus descriptors.  A line that
carries some says how many in its ``"fds"`` field, and they travel in the same
``sendmsg`` as the line's first bytes.  Linux never lets one read span two messages
that carry descriptors, so the receiver gets a line's descriptors no later than the
line itself, in order, and pairs them by count.

Who may talk: besides the directory's permissions, the serving side checks each
connecting peer's credentials (``SO_PEERCRED``): root (the node) or its own user (a
test that runs everything as one user).
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
from kibotos.control_socket import MAX_LINE
from kibotos.core.errors import InvalidArgument, KibotosError, PermissionDenied
from kibotos.core.logs import EventLogger

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


async def serve(path: Path, handle: Handler, *, who: str, log: EventLogger,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer requests on `path` until cancelled; the socket file goes on the way out
    unless another process has bound the path since.  `who` names the serving process
    in a refusal."""
    listener = trio.socket.from_stdlib_socket(control_socket.bind(path, backlog=16))
    inode = os.stat(path).st_ino
    allowed = {0, os.geteuid()}
    try:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                conn, _ = await listener.accept()
                nursery.start_soon(_connection, conn, handle, allowed, who, log)
    finally:
        listener.close()
        control_socket.remove_if_ours(path, inode)


async def _connection(conn: trio.socket.SocketType, handle: Handler, allowed: set[int],
                      who: str, log: EventLogger) -> None:
    channel = Channel(conn)
    with conn:
        try:
            uid = peer_uid(conn)
            if uid not in allowed:
                log.warning("control connection refused", peer_uid=uid)
                await channel.send({"ok": False, **PermissionDenied(
                    f"only the node (root) talks to the {who}").to_wire()})
                return
            while True:
                try:
                    message = await channel.receive()
                except InvalidArgument as exc:
                    await channel.send({"ok": False, **exc.to_wire()})
                    return
                if message is None:
                    return
                answer = await _answer(message, handle, log)
                try:
                    await channel.send(answer.body, answer.fds)
                finally:
                    answer.close_fds()  # sent (the peer has its own copies) or not
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            channel.close()


async def _answer(message: Message, handle: Handler, log: EventLogger) -> Message:
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


async def call(path: Path, body: dict[str, Any], fds: Sequence[int] = (), *, who: str,
               timeout: float = 5.0) -> Message:
    """One request to the process (`who`) at `path`; its result with the descriptors it
    sent (the caller owns them), or the error it answered.

    No process listening is `Unavailable`, no answer within `timeout` seconds
    `DeadlineExceeded`.
    """
    with control_socket.deadline(path, who, body.get("type"), timeout):
        sock = await control_socket.connect(path, who)
        with sock:
            channel = Channel(sock)
            try:
                await channel.send(body, fds)
                answer = await channel.receive()
            finally:
                channel.close()
    try:
        result = control_socket.result_of(None if answer is None else answer.body, path,
                                          who)
    except KibotosError:
        if answer is not None:
            answer.close_fds()
        raise
    assert answer is not None
    return Message(result, answer.fds)
