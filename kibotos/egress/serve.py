"""`serve_egress`: one egress process, from its control socket to its exit.

It starts with nothing: no state, no sockets.  The node hands over the routing state
(``state``) and then each Instance's sockets (``sockets``, descriptors attached), and
may take copies back for the next generation (``give-sockets``).  Requests:

* ``{"type": "status"}`` → ``{generation, build, pid, draining, drain_remaining,
  has_state, version, credentials (how many routes hold some), tunnels, queries,
  sockets: {instance_id: [role, …]}, counters}``;
* ``{"type": "state", generation, resolvers, instances}`` → ``{version}``: the whole
  routing state (`kibotos.egress.state`), replaced at once; sockets of Instances or
  roles it no longer lists are closed;
* ``{"type": "sockets", instance_id, roles}`` with one descriptor per role →
  ``{instance_id, roles}``: the sockets are served from now on (the same socket handed
  twice is kept once);
* ``{"type": "give-sockets", instance_id}`` → ``{instance_id, roles}`` with a copy of
  each socket's descriptor, for the node to hand to a newer generation;
* ``{"type": "drain", deadline}`` → ``{tunnels, queries}``: stop accepting and reading,
  drop the credentials, answer the queries already received within `DNS_GRACE`
  seconds, keep the tunnels at most `deadline` seconds more, and exit once nothing is
  left (spec: "Egress processes").

SIGTERM or SIGINT ends the process at once: every tunnel is reset (how the node ends
the oldest generation when a third one is about to start draining).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from kibotos.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kibotos.core.logs import EventLogger
from kibotos.egress import dns_wire, wire
from kibotos.egress.build import build_id
from kibotos.egress.dns_forward import forward, read_framed
from kibotos.egress.sockets import check_role, matches_role, original_destination
from kibotos.egress.state import EgressState, InstanceRoute, parse_state
from kibotos.egress.tunnel import reset, tunnel
from kibotos.egress.upstream import NameResolver

log = EventLogger("kibotos.egress")

#: A draining process answers the queries it already received within this long.
DNS_GRACE = 4.0
#: Queries of one Instance being answered at once; more are dropped (the guest retries).
MAX_QUERIES_PER_INSTANCE = 64
#: A guest's DNS-over-TCP connection with no query for this long is closed (RFC 7766).
DNS_TCP_IDLE = 10.0


@dataclass(frozen=True)
class EgressSettings:
    """The command line of ``kibotos egress serve``."""

    socket_dir: Path
    generation: int
    handle_signals: bool = True
    dns_grace: float = DNS_GRACE


@dataclass
class _Served:
    """One socket of one Instance and the task serving it."""

    role: str
    sock: trio.socket.SocketType
    inode: int
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    def close(self) -> None:
        self.scope.cancel()
        self.sock.close()


class _Tracked:
    """Running tasks of one kind (tunnels, queries) by cancel scope, so a drain can give
    them a deadline and wait for them to end."""

    def __init__(self) -> None:
        self.scopes: dict[int, trio.CancelScope] = {}
        self._ids = itertools.count(1)
        self._changed = trio.Event()

    @contextlib.contextmanager
    def track(self) -> Iterator[trio.CancelScope]:
        key = next(self._ids)
        with trio.CancelScope() as scope:
            self.scopes[key] = scope
            try:
                yield scope
            finally:
                del self.scopes[key]
                self._changed.set()

    def set_deadline(self, deadline: float) -> None:
        for scope in self.scopes.values():
            scope.deadline = min(scope.deadline, deadline)

    def cancel_all(self) -> None:
        for scope in self.scopes.values():
            scope.cancel()

    async def wait_empty(self) -> None:
        while self.scopes:
            self._changed = trio.Event()
            await self._changed.wait()

    def __len__(self) -> int:
        return len(self.scopes)


class EgressServer:
    def __init__(self, settings: EgressSettings) -> None:
        self.settings = settings
        self.state: EgressState | None = None
        self.routes: dict[str, InstanceRoute] = {}
        self.names = NameResolver(())
        self.served: dict[str, dict[str, _Served]] = {}
        self.tunnels = _Tracked()
        self.queries = _Tracked()
        self.counters = {"tunnels_opened": 0, "tunnels_refused": 0, "queries_answered": 0,
                         "queries_failed": 0, "queries_dropped": 0}
        self.draining = False
        self.drain_until: float | None = None  # trio time
        self.version = 0
        self._nursery: trio.Nursery | None = None
        self._done = trio.Event()

    # ---------------------------------------------------------------- control

    async def on_control(self, message: wire.Message) -> wire.Message:
        body = message.body
        kind = body["type"]
        if kind == "status":
            return wire.Message(self.status())
        if kind == "state":
            return wire.Message(self._take_state(body))
        if kind == "sockets":
            return wire.Message(self._take_sockets(body, message))
        if kind == "give-sockets":
            return self._give_sockets(body)
        if kind == "drain":
            return wire.Message(self._drain(body))
        raise InvalidArgument(f"unknown control request type {kind!r}")

    def status(self) -> dict[str, Any]:
        return {"generation": self.settings.generation, "build": build_id(),
                "pid": os.getpid(), "draining": self.draining,
                "drain_remaining": None if self.drain_until is None else
                max(0.0, self.drain_until - trio.current_time()),
                "has_state": self.state is not None, "version": self.version,
                "credentials": sum(1 for r in self.routes.values()
                                   if r.egress is not None and r.egress.authenticated),
                "tunnels": len(self.tunnels), "queries": len(self.queries),
                "sockets": {i: sorted(s) for i, s in self.served.items()},
                "counters": dict(self.counters)}

    def _refuse_when_draining(self, what: str) -> None:
        if self.draining:
            raise FailedPrecondition(f"egress generation {self.settings.generation} is "
                                     f"draining: it takes no {what}")

    def _take_state(self, body: dict[str, Any]) -> dict[str, Any]:
        self._refuse_when_draining("state")
        state = parse_state(body)
        if state.generation != self.settings.generation:
            raise FailedPrecondition(f"state for generation {state.generation} sent to "
                                     f"generation {self.settings.generation}")
        self.state, self.routes = state, state.by_instance()
        if tuple(state.resolvers) != self.names.resolvers:
            self.names = NameResolver(state.resolvers)
        for instance_id in list(self.served):
            wanted = set(self.routes[instance_id].roles) if instance_id in self.routes else set()
            for role in list(self.served[instance_id]):
                if role not in wanted:
                    self.served[instance_id].pop(role).close()
            if not self.served[instance_id]:
                del self.served[instance_id]
        self.version += 1
        log.info("state taken", generation=state.generation, version=self.version,
                 instances=len(state.instances),
                 egresses=sorted({f"{i.egress.name}@{i.egress.revision}"
                                  for i in state.instances if i.egress}))
        return {"version": self.version}

    def _take_sockets(self, body: dict[str, Any], message: wire.Message) -> dict[str, Any]:
        self._refuse_when_draining("sockets")
        instance_id, roles = body.get("instance_id"), body.get("roles")
        route = self.routes.get(instance_id) if isinstance(instance_id, str) else None
        if route is None or not isinstance(instance_id, str):
            raise NotFound(f"sockets for Instance {instance_id!r}, which the state does "
                           "not list")
        if not isinstance(roles, list) or len(roles) != len(message.fds):
            raise InvalidArgument(f"sockets: {len(message.fds)} descriptors for roles "
                                  f"{roles!r}")
        socks: list[tuple[str, socket.socket]] = []
        fds, message.fds = message.fds, []
        try:
            for role, fd in zip(roles, fds, strict=True):
                check_role(role)
                sock = socket.socket(fileno=fd)
                socks.append((role, sock))
                if not matches_role(sock, role) or role not in route.roles:
                    raise InvalidArgument(f"sockets: descriptor for {role} of Instance "
                                          f"{instance_id} is not one (or not listed)")
        except BaseException:
            for fd in fds[len(socks):]:
                os.close(fd)
            for _, sock in socks:
                sock.close()
            raise
        held = self.served.setdefault(instance_id, {})
        for role, sock in socks:
            inode = os.fstat(sock.fileno()).st_ino
            current = held.get(role)
            if current is not None and current.inode == inode:
                sock.close()  # the very socket this process serves already
                continue
            if current is not None:
                current.close()
            served = held[role] = _Served(role, trio.socket.from_stdlib_socket(sock), inode)
            assert self._nursery is not None
            self._nursery.start_soon(self._serve_socket, instance_id, served)
        log.info("sockets taken", instance_id=instance_id, roles=sorted(held))
        return {"instance_id": instance_id, "roles": sorted(held)}

    def _give_sockets(self, body: dict[str, Any]) -> wire.Message:
        instance_id = body.get("instance_id")
        held = self.served.get(instance_id, {}) if isinstance(instance_id, str) else {}
        roles = sorted(held)
        fds = [os.dup(held[r].sock.fileno()) for r in roles]
        return wire.Message({"instance_id": instance_id, "roles": roles}, fds)

    # ---------------------------------------------------------------- serving

    async def _serve_socket(self, instance_id: str, served: _Served) -> None:
        with served.scope:
            try:
                if served.role.startswith("dns-udp"):
                    await self._serve_udp(instance_id, served.sock)
                else:
                    await self._accept(instance_id, served)
            except (OSError, trio.ClosedResourceError) as exc:
                if not served.scope.cancel_called:
                    log.error("socket stopped", instance_id=instance_id, role=served.role,
                              error=str(exc))

    def _guest_ok(self, instance_id: str, peer: Any) -> InstanceRoute | None:
        route = self.routes.get(instance_id)
        if route is None or not isinstance(peer, tuple) or peer[0] not in route.guest:
            return None
        return route

    async def _accept(self, instance_id: str, served: _Served) -> None:
        while True:
            conn, peer = await served.sock.accept()
            assert self._nursery is not None
            if served.role.startswith("dns-tcp"):
                self._nursery.start_soon(self._dns_tcp, instance_id, conn, peer)
            else:
                self._nursery.start_soon(self._tunnel, instance_id, conn, peer)

    async def _tunnel(self, instance_id: str, conn: trio.socket.SocketType, peer: Any) -> None:
        stream = trio.SocketStream(conn)
        with self.tunnels.track():
            route = self._guest_ok(instance_id, peer)
            try:
                destination = original_destination(conn)
            except OSError:
                destination = conn.getsockname()[:2]
            if route is None or destination[:2] == conn.getsockname()[:2]:
                self.counters["tunnels_refused"] += 1
                reset(stream)
                log.info("guest connection refused", instance_id=instance_id,
                         peer=peer[0] if isinstance(peer, tuple) else peer,
                         reason="not from the Instance's guest, or not redirected")
                return
            problem = await tunnel(stream, (destination[0], destination[1]), route.egress,
                                   self.names)
            if problem is None:
                self.counters["tunnels_opened"] += 1
                return
            self.counters["tunnels_refused"] += 1
            log.info("guest connection reset", instance_id=instance_id,
                     destination=f"{destination[0]}:{destination[1]}", reason=problem)

    async def _answer(self, route: InstanceRoute, query: bytes, *, over_tcp: bool
                      ) -> bytes | None:
        if route.resolver is None:
            return None
        try:
            answer = await forward(query, route.resolver, route.egress, self.names,
                                   over_tcp=over_tcp)
        except Exception as exc:
            self.counters["queries_failed"] += 1
            log.info("guest query not answered", instance_id=route.instance_id,
                     resolver=route.resolver.name, error=str(exc))
            return None
        self.counters["queries_answered"] += 1
        return answer

    async def _serve_udp(self, instance_id: str, sock: trio.socket.SocketType) -> None:
        busy = _Tracked()
        while True:
            query, peer = await sock.recvfrom(dns_wire.MAX_MESSAGE)
            route = self._guest_ok(instance_id, peer)
            if route is None or not dns_wire.is_query(query):
                continue
            if len(busy) >= MAX_QUERIES_PER_INSTANCE:
                self.counters["queries_dropped"] += 1
                continue
            assert self._nursery is not None
            self._nursery.start_soon(self._udp_query, route, sock, query, peer, busy)

    async def _udp_query(self, route: InstanceRoute, sock: trio.socket.SocketType,
                         query: bytes, peer: Any, busy: _Tracked) -> None:
        with self.queries.track(), busy.track():
            answer = await self._answer(route, query, over_tcp=False)
            if answer is not None:
                with contextlib.suppress(OSError):
                    await sock.sendto(answer, peer)

    async def _dns_tcp(self, instance_id: str, conn: trio.socket.SocketType, peer: Any
                       ) -> None:
        stream = trio.SocketStream(conn)
        with self.queries.track():
            route = self._guest_ok(instance_id, peer)
            if route is None:
                reset(stream)
                return
            buffer = bytearray()
            async with stream:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError,
                                         OSError, dns_wire.DnsFormatError):
                    while not self.draining:
                        query = None
                        with trio.move_on_after(DNS_TCP_IDLE):
                            query = await read_framed(stream, buffer)
                        if query is None or not dns_wire.is_query(query):
                            return
                        answer = await self._answer(route, query, over_tcp=True)
                        if answer is None:
                            return
                        await stream.send_all(dns_wire.framed(answer))

    # ---------------------------------------------------------------- drain and exit

    def _drain(self, body: dict[str, Any]) -> dict[str, Any]:
        deadline = body.get("deadline")
        if isinstance(deadline, bool) or not isinstance(deadline, int | float) or \
                not 0 <= deadline <= 7 * 86400:
            raise InvalidArgument(f"drain: deadline must be 0 to 604800 seconds, got "
                                  f"{deadline!r}")
        now = trio.current_time()
        self.tunnels.set_deadline(now + deadline)
        self.drain_until = min(self.drain_until or now + deadline, now + deadline)
        if not self.draining:
            self.draining = True
            if self.state is not None:
                self.state = self.state.without_credentials()
                self.routes = self.state.by_instance()
            self.queries.set_deadline(now + self.settings.dns_grace)
            udp = []
            for held in self.served.values():
                for served in held.values():
                    if served.role.startswith("dns-udp"):
                        served.scope.cancel()  # stop reading; answers still go out on it
                        udp.append(served.sock)
                    else:
                        served.close()
            self.served = {}
            assert self._nursery is not None
            self._nursery.start_soon(self._finish_drain, udp)
            log.info("egress generation draining", generation=self.settings.generation,
                     tunnels=len(self.tunnels), queries=len(self.queries),
                     deadline=f"{deadline:g}s")
        return {"tunnels": len(self.tunnels), "queries": len(self.queries)}

    async def _finish_drain(self, udp: list[trio.socket.SocketType]) -> None:
        await trio.sleep(0.5)  # so the answer to ``drain`` gets out first
        await self.queries.wait_empty()
        for sock in udp:
            sock.close()
        await self.tunnels.wait_empty()
        log.info("egress generation drained", generation=self.settings.generation,
                 counters=" ".join(f"{k}={v}" for k, v in self.counters.items()))
        self._done.set()

    def end_now(self, reason: str) -> None:
        log.info("egress process ending", generation=self.settings.generation,
                 reason=reason, tunnels_reset=len(self.tunnels), queries=len(self.queries))
        self.tunnels.cancel_all()
        self.queries.cancel_all()
        self._done.set()

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            async for signum in received:
                self.end_now(signal.Signals(signum).name)
                return

    async def serve(self, *, task_status: trio.TaskStatus[EgressServer]
                    = trio.TASK_STATUS_IGNORED) -> None:
        directory = self.settings.socket_dir
        check_socket_dir(directory)
        control = wire.control_path(directory, self.settings.generation)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(wire.serve, control, self.on_control)
            if self.settings.handle_signals:
                nursery.start_soon(self._signals)
            log.info("egress serving", generation=self.settings.generation,
                     control=control, pid=os.getpid(), uid=os.geteuid(), build=build_id())
            task_status.started(self)
            await self._done.wait()
            # the tunnels' own resets run on the way out of their cancelled scopes
            with trio.move_on_after(2.0):
                await self.tunnels.wait_empty()
            nursery.cancel_scope.cancel()
        for held in self.served.values():
            for served in held.values():
                served.close()


def check_socket_dir(directory: Path) -> None:
    """The directory the node prepared: this process's own, closed to everyone else."""
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        raise FailedPrecondition(f"egress socket directory {directory} does not exist (the "
                                 "node creates it)") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or \
            info.st_mode & 0o077:
        raise FailedPrecondition(f"egress socket directory {directory} must be a directory "
                                 f"of uid {os.geteuid()} with mode 0700 (it is uid "
                                 f"{info.st_uid}, mode {stat.S_IMODE(info.st_mode):o})")


async def serve_egress(settings: EgressSettings, *,
                       task_status: trio.TaskStatus[EgressServer]
                       = trio.TASK_STATUS_IGNORED) -> None:
    """Run one egress process until it drained or a signal ends it."""
    await EgressServer(settings).serve(task_status=task_status)
