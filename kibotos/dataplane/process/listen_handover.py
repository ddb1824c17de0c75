"""The listening socket and the state, passed from one data-plane generation to the next.

When the node moves to another build on the same release line, the new generation
takes over the old one's *listening socket* instead of binding the address again
(spec: node-and-vmm-processes, "Data-plane processes"): the socket never closes, so no
connection is refused while the generations change, and connections the old one holds
are not touched.  The old one stops accepting only when the node tells it to
(``drain``), after the new one serves; it then exits when its last connection ends.

Each generation serves ``<socket_dir>/dataplane/g<N>.sock`` (the same
directory as the control socket, 0700; the socket 0600; peers checked by
``SO_PEERCRED``) for its whole life, so the node reaches a draining generation beside
the one that holds ``control.sock``.  Requests (`kibotos.core.fd_control`, JSON lines with
descriptors beside them):

* ``{"type": "listeners"}`` → ``{generation, count, replay}`` and the listening
  sockets as descriptors (SCM_RIGHTS); ``replay`` is the last control message of each
  kind in `REPLAYED` that the node handed this generation (the state: Instances and
  key; the TLS certificate and its key), which the new one takes before its first
  accept, so it serves the same Instances with the same key and certificate at once;
* ``{"type": "drain"}`` → ``{draining: true}``: stop accepting, exit after the last
  connection ends;
* ``{"type": "state", …}``, ``{"type": "status"}``, ``{"type": "metrics"}``: as on the
  control socket (the node uses these while a failed handover left this generation
  current: a successor that died after binding ``control.sock`` took its path).

The sockets are plain TCP listeners: TLS, where it is on, wraps each accepted
connection, so the handover is the same with and without it.  The receiving side
checks what it got (a listening TCP socket on the configured port) before it accepts
anything on it; the named failpoint ``dataplane.handover.after-receive`` kills the new
generation right there, where a crash leaves the old one accepting alone.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import trio

from kibotos.control_socket import check_socket_path
from kibotos.core import failpoints, fd_control
from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.core.fd_control import Message
from kibotos.core.logs import EventLogger

log = EventLogger("kibotos.dataplane")

WHO = "data-plane generation"
#: No longer than ``control.sock`` (below generation 1,000,000), so the node's
#: ``socket_dir`` length check (`kibotos.config`) holds for it too.
GENERATION_SOCKET = "g{generation}.sock"
AFTER_RECEIVE = "dataplane.handover.after-receive"
AFTER_CONTROL = "dataplane.serve.after-control"
#: Requests the generation socket passes on to the control handler unchanged: the
#: node reaches an old generation that stays current after a failed handover here,
#: since its successor took the control socket's path.
FORWARDED = ("state", "status", "metrics")
#: The node's control messages a new generation must have before it accepts, in the
#: order it takes them (without the certificate, a TLS successor would fail every
#: handshake until the node's next supply: tests/dataplane/test_handover_tls.py).
REPLAYED = ("state", "certificate")

class _Descriptor(Protocol):
    """A stdlib or a trio socket."""

    def fileno(self) -> int: ...


ControlHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def generation_path(socket_dir: Path, generation: int) -> Path:
    """Where generation `generation` answers for its whole life."""
    return check_socket_path(socket_dir / "dataplane" /
                             GENERATION_SOCKET.format(generation=generation))


@dataclass
class Inherited:
    """What a new generation took over: the listening sockets and the node's messages."""

    sockets: list[socket.socket]
    replay: list[dict[str, Any]]
    from_generation: int


def check_listener(sock: socket.socket, host: str, port: int) -> None:
    """That `sock` is a listening TCP socket bound to ``host:port`` (a wildcard or
    name host is checked by port only): a descriptor of the wrong kind must never be
    served on."""
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                             socket.AF_INET6):
        raise FailedPrecondition(f"handed-over descriptor is not a TCP socket "
                                 f"(family {sock.family}, type {sock.type})")
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        raise FailedPrecondition("handed-over TCP socket is not listening")
    bound_host, bound_port = sock.getsockname()[:2]
    if bound_port != port:
        raise FailedPrecondition(f"handed-over socket listens on port {bound_port}, "
                                 f"not the configured {port}")
    with contextlib.suppress(ValueError):
        wanted = ipaddress.ip_address(host)
        if not wanted.is_unspecified and ipaddress.ip_address(bound_host) != wanted:
            raise FailedPrecondition(f"handed-over socket listens on {bound_host}, not "
                                     f"the configured {host}")


async def take_listeners(path: Path, *, host: str, port: int, timeout: float = 10.0
                         ) -> Inherited:
    """Ask the generation serving `path` for its listening sockets and state; each
    socket checked (`check_listener`), or all closed and the reason raised."""
    answer = await fd_control.call(path, {"type": "listeners"}, who=WHO, timeout=timeout)
    sockets = [socket.socket(fileno=fd) for fd in answer.fds]
    answer.fds = []
    try:
        if not sockets:
            raise FailedPrecondition(f"the {WHO} on {path} handed over no listening socket")
        for sock in sockets:
            check_listener(sock, host, port)
        replay, sender = answer.body.get("replay"), answer.body.get("generation")
        if not isinstance(replay, list) or not all(
                isinstance(m, dict) and m.get("type") in REPLAYED for m in replay):
            raise InvalidArgument(f"handed-over messages must be a list of objects of "
                                  f"the types {list(REPLAYED)}")
        if not isinstance(sender, int) or isinstance(sender, bool):
            raise InvalidArgument("handed-over generation must be an integer")
    except Exception:
        for sock in sockets:
            sock.close()
        raise
    failpoints.hit(AFTER_RECEIVE)
    return Inherited(sockets, replay, sender)


class HandoverPoint:
    """The serving side: hands out duplicates of this generation's listening sockets
    with the node's last messages (`recording`), and sets `drain_requested` when the
    node asks it to drain."""

    def __init__(self, generation: int, control: ControlHandler) -> None:
        self.generation = generation
        self.control = control
        self.listening: Sequence[_Descriptor] = ()
        self.taken: dict[str, dict[str, Any]] = {}
        self.drain_requested = trio.Event()

    async def recording(self, message: dict[str, Any]) -> dict[str, Any]:
        """The control handler, keeping each `REPLAYED` message it took without error
        (the control socket and a replay at start both go through here)."""
        answer = await self.control(message)
        if message.get("type") in REPLAYED:
            self.taken[str(message["type"])] = message
        return answer

    async def replay(self, inherited: Inherited) -> None:
        """Take the older generation's messages, as this generation's own."""
        for message in inherited.replay:
            own = {**message, "generation": self.generation} if "generation" in message \
                else message
            await self.recording(own)

    async def handle(self, message: Message) -> Message:
        kind = message.body.get("type")
        if kind == "listeners":
            if self.drain_requested.is_set() or not self.listening:
                raise FailedPrecondition(f"generation {self.generation} no longer holds "
                                         "the listening socket")
            fds = [os.dup(sock.fileno()) for sock in self.listening]
            log.info("listening socket handed over", generation=self.generation,
                     sockets=len(fds))
            replay = [self.taken[kind] for kind in REPLAYED if kind in self.taken]
            return Message({"generation": self.generation, "count": len(fds),
                            "replay": replay}, fds)
        if kind == "drain":
            if not self.drain_requested.is_set():
                log.info("data plane draining: a newer generation serves",
                         generation=self.generation)
            self.drain_requested.set()
            return Message({"draining": True})
        if kind in FORWARDED:
            return Message(await self.recording(message.body))
        raise InvalidArgument(f"unknown generation socket request type {kind!r}")

    async def serve(self, path: Path, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        await fd_control.serve(path, self.handle, who=WHO, log=log, task_status=task_status)


async def call(path: Path, body: dict[str, Any], *, timeout: float = 5.0) -> dict[str, Any]:
    """A request without descriptors to a generation's socket (the node's side)."""
    answer = await fd_control.call(path, body, who=WHO, timeout=timeout)
    answer.close_fds()
    return answer.body
