"""``kibo workspace port-forward WS [LOCAL:]REMOTE... [--address A]...``: local TCP ports
forwarded to ports on a Workspace's loopback, in the manner of ``kubectl port-forward``.

It asks ctrl for a session credential that grants ``ports``, listens on 127.0.0.1 (or
the ``--address`` list) and forwards every accepted connection through the Workspace
node's data plane as its own stream (`kibotos.dataplane.clients.ports_client`): bytes both ways
with back-pressure end to end, half-close kept each way, and a message on stderr for a
connection that finds nothing listening in the guest.  It runs until Ctrl-C (or
SIGTERM, or the global ``--timeout``), renewing the credential before it expires so
new connections keep working; connections already open do not need it.

A renewal that ctrl refuses for good (the Workspace is gone or no longer AVAILABLE)
ends the command with that error's exit code, as ``kubectl port-forward`` ends when
its pod goes away; one that fails for a while (ctrl unreachable) is retried.
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import click

from kibotos.cli.core.options import Invocation, kibo_options
from kibotos.core import ids
from kibotos.core.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    KibotosError,
    Unauthenticated,
)

if TYPE_CHECKING:  # trio is imported when the command runs: `--help` stays fast
    import ssl

    import trio

#: Renew after this share of a credential's lifetime, and at least this long before
#: it expires.
RENEW_FRACTION, RENEW_MARGIN = 0.6, 60.0
#: Between attempts after a renewal failed for a reason that may pass.
RENEW_RETRY = 5.0
#: How much is read from a local connection at a time.
LOCAL_CHUNK = 256 * 1024


@dataclass(frozen=True)
class Mapping:
    """One ``[LOCAL:]REMOTE``: LOCAL 0 means any free port."""

    local: int
    remote: int


def parse_mapping(text: str) -> Mapping:
    """``8080:80``, ``80`` (the same port locally) or ``:80`` (any free local port)."""
    local_text, sep, remote_text = text.rpartition(":")
    if not sep:
        local_text = remote_text
    elif not local_text:
        local_text = "0"

    def number(value: str, low: int) -> int:
        if not (value.isascii() and value.isdigit()) or not low <= int(value) <= 65535:
            raise InvalidArgument(f"port mapping {text!r}: expected [LOCAL:]REMOTE with "
                                  "ports from 1 to 65535 (LOCAL may be empty: any free port)")
        return int(value)

    return Mapping(number(local_text, 0), number(remote_text, 1))


def parse_addresses(values: Sequence[str]) -> tuple[list[str], set[str]]:
    """The local addresses to listen on: IP addresses and ``localhost`` (127.0.0.1 and
    ::1), repeated or comma-separated; 127.0.0.1 when none are given.  Also the ones that
    may be missing (``localhost``'s ::1 on a host without IPv6)."""
    found: list[str] = []
    named: set[str] = set()
    for value in values:
        for item in (part.strip() for part in value.split(",")):
            if item == "localhost":
                candidates = ["127.0.0.1", "::1"]
            else:
                try:
                    candidates = [str(ipaddress.ip_address(item))]
                except ValueError:
                    raise InvalidArgument(f"--address {item!r} is not an IP address or "
                                          "'localhost'") from None
                named.update(candidates)
            found += [c for c in candidates if c not in found]
    return found or ["127.0.0.1"], {"::1"} - named if "::1" in found else set()


def _where(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


# ---------------------------------------------------------------------------- credential


@dataclass(frozen=True)
class Session:
    url: str
    credential: str
    renew_at: float  # monotonic
    expires_at: float  # monotonic, by the local clock's reading of ctrl's expiry


def _session(body: Any, now: float, wall: float) -> Session:
    try:
        url, credential = body["dataplane_url"], body["credential"]
        expiry = datetime.fromisoformat(str(body["expires_at"]).replace("Z", "+00:00"))
    except (KeyError, TypeError, ValueError) as exc:
        raise Internal(f"ctrl's session answer is not what kibo expects: {exc!r}") from None
    if not isinstance(url, str) or not isinstance(credential, str):
        raise Internal("ctrl's session answer has no data-plane URL and credential")
    lifetime = max(1.0, expiry.timestamp() - wall)
    renew_in = min(lifetime * RENEW_FRACTION, max(lifetime - RENEW_MARGIN, 0.0))
    return Session(url, credential, now + renew_in, now + lifetime)


class SessionSource:
    """The current session credential for ``ports``, renewed before it expires.

    `fetch` asks ctrl (blocking; it runs in a worker thread).  `current` hands out the
    latest credential, renewing first if it is due; `run` renews in the background and
    reports a refusal that will not pass through `fatal`.
    """

    def __init__(self, fetch: Callable[[], Any], first: Any, *,
                 wall: Callable[[], float] = time.time) -> None:
        import trio

        self._fetch = fetch
        self._wall = wall
        self.session = _session(first, trio.current_time(), wall())
        self.renewals = 0
        self._lock = trio.Lock()

    async def _renew(self) -> Session:
        import trio

        async with self._lock:
            if trio.current_time() < self.session.renew_at:
                return self.session  # another task renewed it meanwhile
            body = await trio.to_thread.run_sync(self._fetch)
            self.session = _session(body, trio.current_time(), self._wall())
            self.renewals += 1
            return self.session

    async def current(self) -> Session:
        import trio

        if trio.current_time() >= self.session.renew_at:
            with contextlib.suppress(KibotosError):  # the old one may still do: try it
                return await self._renew()
        return self.session

    async def renew_now(self) -> Session:
        """After the data plane refused the credential (a clock between kibo and ctrl
        that is off): a fresh one at once."""
        self.session = Session(self.session.url, self.session.credential, 0.0,
                               self.session.expires_at)
        return await self._renew()

    async def run(self, fatal: Callable[[KibotosError], None],
                  warn: Callable[[str], None]) -> None:
        import trio

        warned = False
        while True:
            await trio.sleep_until(self.session.renew_at)
            try:
                await self._renew()
                warned = False
            except KibotosError as exc:
                if not exc.retryable:
                    fatal(exc)
                    return
                if not warned:
                    warn(f"could not renew the session credential ({exc.message}); "
                         "retrying: connections opened after it expires will fail")
                    warned = True
                await trio.sleep(RENEW_RETRY)


# ---------------------------------------------------------------------------- forwarding


class Forwarder:
    """The listeners and the connections of one ``port-forward``."""

    def __init__(self, source: SessionSource, mappings: Sequence[Mapping],
                 addresses: Sequence[str], *, line: Callable[[str], None],
                 message: Callable[[str], None], announce_connections: bool = True,
                 optional: set[str] | None = None,
                 tls: Callable[[str], ssl.SSLContext | None] = lambda url: None) -> None:
        """`tls` gives the context a data-plane URL is verified with (kibo's cluster
        CA for ``https://``)."""
        self.source = source
        self.tls = tls
        self.mappings = list(mappings)
        self.addresses = list(addresses)
        self.optional = optional or set()
        self.line = line
        self.message = message
        self.announce = announce_connections
        self.bound: list[tuple[str, int, int]] = []  # (address, local port, remote port)

    async def run(self, *, task_status: Any = None) -> None:
        """Listen on every address for every mapping, then forward until cancelled;
        `task_status` (``nursery.start``) gets what was bound."""
        import trio

        listeners: list[tuple[trio.SocketListener, int]] = []
        try:
            for mapping in self.mappings:
                port = mapping.local
                for address in self.addresses:
                    try:
                        listener = await _listen(address, port)
                    except InvalidArgument as exc:
                        if address not in self.optional:
                            raise
                        self.message(f"warning: {exc.message} (skipped)")
                        continue
                    port = listener.socket.getsockname()[1]  # the same on every address
                    listeners.append((listener, mapping.remote))
                    self.bound.append((address, port, mapping.remote))
        except BaseException:
            for listener, _ in listeners:
                await listener.aclose()
            raise
        async with trio.open_nursery() as nursery:
            for listener, remote in listeners:
                nursery.start_soon(self._accept, listener, remote, nursery)
            if task_status is not None:
                task_status.started(self.bound)

    async def _accept(self, listener: trio.SocketListener, remote: int,
                      nursery: trio.Nursery) -> None:
        import trio

        sockname = listener.socket.getsockname()
        label = f"{_where(sockname[0], sockname[1])} -> {remote}"
        async with listener:
            while True:
                try:
                    local = await listener.accept()
                except OSError as exc:  # EMFILE and the like: not the end of forwarding
                    self.message(f"error: accepting on {label}: {exc}")
                    await trio.sleep(0.1)
                    continue
                if self.announce:
                    self.line(f"Handling connection for {sockname[1]}")
                nursery.start_soon(self._connection, local, remote, label)

    async def _connection(self, local: trio.SocketStream, remote: int, label: str) -> None:
        from kibotos.dataplane.clients.ports_client import open_port

        async with local:
            session = await self.source.current()
            try:
                try:
                    async with open_port(session.url, session.credential, remote,
                                         ssl_context=self.tls(session.url)) as conn:
                        await _relay(local, conn)
                except Unauthenticated:
                    session = await self.source.renew_now()
                    async with open_port(session.url, session.credential, remote,
                                         ssl_context=self.tls(session.url)) as conn:
                        await _relay(local, conn)
            except KibotosError as exc:
                self.message(f"error: {label}: {exc.message.removeprefix('port_open: ')}")
                _reset(local)


async def _listen(address: str, port: int) -> trio.SocketListener:
    import trio

    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        await sock.bind((address, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise InvalidArgument(f"cannot listen on {_where(address, port)}: "
                              f"{exc.strerror or exc}") from None
    return trio.SocketListener(sock)


async def _relay(local: trio.SocketStream, conn: Any) -> None:
    """Both directions to their ends; a failure of either side is raised (a reset in
    the guest as the KibotosError it was), the local side's own as nothing."""
    import trio

    async def up() -> None:
        while data := await local.receive_some(LOCAL_CHUNK):
            await conn.send_all(data)
        await conn.send_eof()

    async def down() -> None:
        while data := await conn.receive_some():
            await local.send_all(data)
        with contextlib.suppress(OSError, trio.BrokenResourceError,
                                 trio.ClosedResourceError):
            await local.send_eof()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(up)
            nursery.start_soon(down)
    except BaseExceptionGroup as group:
        from kibotos.dataplane.process.groups import kibotos_leaf, leaves

        for leaf in leaves(group):
            cause = leaf.__cause__
            if isinstance(leaf, trio.BrokenResourceError) and isinstance(cause, KibotosError):
                raise cause from None  # the guest side broke: say so
        leaf_error = kibotos_leaf(group)
        if leaf_error is not None:
            raise leaf_error from None
        return  # the local client went away: its connection is simply over
    error = await conn.finish()
    if error is not None:
        raise error


def _reset(local: trio.SocketStream) -> None:
    """Close with a reset, so the local client sees the failure, not a clean end."""
    with contextlib.suppress(OSError):
        local.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


# ---------------------------------------------------------------------------- the command


async def forward_until_stopped(inv: Invocation, source: SessionSource,
                                forwarder: Forwarder) -> int:
    import trio

    failure: list[KibotosError] = []
    remaining = inv.deadline.remaining()
    async with trio.open_nursery() as nursery:
        def fatal(exc: KibotosError) -> None:
            failure.append(exc)
            nursery.cancel_scope.cancel()

        bound = await nursery.start(forwarder.run)
        if inv.as_json:
            inv.out.json_result({"forwarding": [
                {"address": a, "local_port": p, "remote_port": r} for a, p, r in bound]})
        else:
            for address, port, remote in bound:
                inv.out.line(f"Forwarding from {_where(address, port)} -> {remote}")
        nursery.start_soon(source.run, fatal, inv.out.warning)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            with trio.move_on_after(remaining if remaining is not None else float("inf")):
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return 0
            if remaining is not None:
                failure.append(DeadlineExceeded(
                    f"the global --timeout of {inv.deadline.seconds:g}s passed; port "
                    "forwarding stopped"))
        nursery.cancel_scope.cancel()
    if failure:
        raise failure[0]
    return 0


@click.command("port-forward")
@click.argument("workspace")
@click.argument("ports", nargs=-1, required=True, metavar="[LOCAL:]REMOTE...")
@click.option("--address", "addresses", multiple=True, metavar="ADDR",
              help="Local address to listen on: an IP address or 'localhost' (repeatable "
                   "or comma-separated; default 127.0.0.1).")
@kibo_options
def port_forward_command(inv: Invocation, workspace: str, ports: tuple[str, ...],
                         addresses: tuple[str, ...]) -> None:
    """Forward local ports to ports on the loopback of the AVAILABLE Workspace WORKSPACE
    until Ctrl-C.

    \b
    kibo workspace port-forward ws-01k… 8080            (local 8080 -> guest 8080)
    kibo workspace port-forward ws-01k… 8000:80 :5432   (any free local port -> 5432)
    kibo workspace port-forward ws-01k… 8080 --address localhost,192.168.1.5
    """
    ids.check_object_id(workspace, "workspace ID")
    mappings = [parse_mapping(p) for p in ports]
    local_addresses, optional = parse_addresses(addresses)
    client = inv.client()

    def fetch() -> Any:
        return client.post(f"/v1/workspaces/{workspace}/sessions", {"operations": ["ports"]},
                           write=False)

    first = fetch()  # a missing or stopped Workspace fails here, before listening

    import trio

    from kibotos.dataplane.process.groups import sole_error

    async def main() -> int:
        source = SessionSource(fetch, first)
        forwarder = Forwarder(source, mappings, local_addresses, line=inv.out.line,
                              message=inv.out.message, announce_connections=not inv.as_json,
                              optional=optional, tls=inv.dataplane_tls)
        return await forward_until_stopped(inv, source, forwarder)

    try:
        code = trio.run(main)
    except BaseExceptionGroup as group:
        leaf = sole_error(group)
        if leaf is None:
            raise
        raise leaf from None
    raise click.exceptions.Exit(code)
