"""One guest TCP connection through the Instance's Egress, failing closed.

The guest's connection arrives redirected; its original destination is where the
SOCKS5 server is asked to CONNECT (by address: the guest resolved the name itself).
Whatever goes wrong before the tunnel stands (the SOCKS5 server unreachable, the
credentials refused, CONNECT refused, no Egress for this Instance any more, a draining
process without credentials), the guest's connection is reset: there is no direct path
to fall back to, and a reset tells the guest at once rather than after its timeout.
Once it stands, bytes are copied both ways with half-closes passed on, and a reset on
one side resets the other.
"""

from __future__ import annotations

import contextlib

import trio

from kibotos.core.errors import KibotosError, Unavailable
from kibotos.egress import socks5
from kibotos.egress.sockets import SO_LINGER_RESET
from kibotos.egress.state import EgressRoute
from kibotos.egress.upstream import NameResolver

#: From the accepted guest connection to a standing tunnel, at most.
CONNECT_TIMEOUT = 15.0
CHUNK = 65536


async def open_through(egress: EgressRoute, names: NameResolver, host: str, port: int, *,
                       timeout: float = CONNECT_TIMEOUT) -> tuple[trio.SocketStream, bytes]:
    """A stream to ``host:port`` through the SOCKS5 server of `egress`, and the bytes
    the server already relayed from the destination; `Unavailable` naming the step
    that failed."""
    server = egress.endpoint
    try:
        with trio.fail_after(timeout):
            stream = await names.open_tcp(server.host, server.port)
            try:
                _, early = await socks5.connect(stream, host, port, username=egress.username,
                                                password=egress.password)
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
    except trio.TooSlowError:
        raise Unavailable(f"egress {egress.name}: no tunnel to {host}:{port} within "
                          f"{timeout:g}s") from None
    except socks5.SocksError as exc:
        raise Unavailable(f"egress {egress.name}: {exc}") from None
    except (OSError, trio.BrokenResourceError) as exc:
        raise Unavailable(f"egress {egress.name}: the SOCKS5 server at {server} dropped "
                          f"the connection: {exc}") from None
    return stream, early


def reset(stream: trio.SocketStream) -> None:
    """Close `stream` with a TCP reset."""
    with contextlib.suppress(OSError, trio.ClosedResourceError):
        stream.setsockopt(*SO_LINGER_RESET)
    stream.socket.close()


async def _pump(source: trio.SocketStream, sink: trio.SocketStream) -> int:
    moved = 0
    while data := await source.receive_some(CHUNK):
        await sink.send_all(data)
        moved += len(data)
    await sink.send_eof()
    return moved


async def relay(guest: trio.SocketStream, upstream: trio.SocketStream,
                early: bytes = b"") -> None:
    """Copy both ways until both sides ended.  A broken side resets the other, and so
    does a cancellation (the drain deadline): a guest must not take a cut-off transfer
    for a complete one."""
    clean = False
    try:
        if early:
            await guest.send_all(early)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pump, guest, upstream)
            nursery.start_soon(_pump, upstream, guest)
        clean = True
    except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        if clean:
            await trio.aclose_forcefully(guest)
            await trio.aclose_forcefully(upstream)
        else:
            reset(guest)
            reset(upstream)


async def tunnel(guest: trio.SocketStream, destination: tuple[str, int],
                 egress: EgressRoute | None, names: NameResolver) -> str | None:
    """Serve one guest connection; None when the tunnel stood, else why the guest's
    connection was reset."""
    if egress is None:
        reset(guest)
        return "the Instance has no egress"
    try:
        upstream, early = await open_through(egress, names, *destination)
    except KibotosError as exc:
        reset(guest)
        return exc.message
    await relay(guest, upstream, early)
    return None
