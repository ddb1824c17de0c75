"""A guest's DNS query to its Resolver's upstream, direct or through the Egress.

Direct: from the host's network namespace as ``kibotos-egress`` (the host's routes and
any restriction of the node's own outbound traffic apply), over UDP for a UDP query
(a fresh socket per query, so the source port is random and only the upstream's reply
is read) and over TCP for a TCP query; an upstream written as a host name is resolved
with the node's resolver list (`kibotos.egress.upstream`).

Through the Egress: DNS over TCP (RFC 1035 4.2.2, RFC 7766) inside a SOCKS5 CONNECT to
the upstream; a name is passed to the SOCKS5 server as a name, so an upstream that only
the caller's network knows resolves there.

The message is forwarded as the guest sent it, ID included, and the answer returned
as the upstream sent it: the guest's own resolver library matches them.
"""

from __future__ import annotations

import socket
import struct

import trio

from kibotos.core.errors import FailedPrecondition, KibotosError, Unavailable
from kibotos.egress import dns_wire
from kibotos.egress.state import EgressRoute, ResolverRoute
from kibotos.egress.tunnel import open_through
from kibotos.egress.upstream import NameResolver

#: One query, upstream included, at most.
QUERY_TIMEOUT = 5.0
#: Direct UDP: ask again after this long without an answer.
UDP_RETRY = 1.5


async def read_framed(stream: trio.abc.ReceiveStream, buffer: bytearray) -> bytes | None:
    """One length-prefixed DNS message; None at a clean end between messages."""
    while True:
        if len(buffer) >= 2:
            (length,) = struct.unpack_from("!H", buffer)
            if len(buffer) >= 2 + length:
                message = bytes(buffer[2:2 + length])
                del buffer[:2 + length]
                return message
        data = await stream.receive_some(65536)
        if not data:
            if buffer:
                raise dns_wire.DnsFormatError("the connection ended inside a DNS message")
            return None
        buffer += data


async def _exchange_tcp(stream: trio.abc.Stream, query: bytes) -> bytes:
    await stream.send_all(dns_wire.framed(query))
    answer = await read_framed(stream, bytearray())
    if answer is None:
        raise Unavailable("the upstream closed the connection without an answer")
    return answer


async def _direct_udp(address: str, port: int, query: bytes) -> bytes:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    qid = dns_wire.message_id(query)
    with trio.socket.socket(family, socket.SOCK_DGRAM) as sock:
        await sock.connect((address, port))
        while True:
            await sock.send(query)
            with trio.move_on_after(UDP_RETRY):
                while True:
                    reply = await sock.recv(dns_wire.MAX_MESSAGE)
                    if len(reply) >= dns_wire.HEADER and dns_wire.message_id(reply) == qid:
                        return reply


async def forward(query: bytes, resolver: ResolverRoute, egress: EgressRoute | None,
                  names: NameResolver, *, over_tcp: bool,
                  timeout: float = QUERY_TIMEOUT) -> bytes:
    """The upstream's answer to `query`; `KibotosError` when there is none in time."""
    upstream = resolver.endpoint
    try:
        with trio.fail_after(timeout):
            if resolver.via_egress:
                if egress is None:
                    raise FailedPrecondition(f"resolver {resolver.name} goes through an "
                                             "egress the Instance does not have")
                stream, early = await open_through(egress, names, upstream.host,
                                                   upstream.port, timeout=timeout)
                async with stream:
                    if early:
                        raise Unavailable("the upstream spoke before the query")
                    return await _exchange_tcp(stream, query)
            addresses = await names.addresses(upstream.host)
            if over_tcp:
                stream = await names.open_tcp(upstream.host, upstream.port)
                async with stream:
                    return await _exchange_tcp(stream, query)
            return await _direct_udp(addresses[0], upstream.port, query)
    except trio.TooSlowError:
        raise Unavailable(f"resolver {resolver.name}: no answer from {upstream} within "
                          f"{timeout:g}s") from None
    except (OSError, trio.BrokenResourceError, dns_wire.DnsFormatError) as exc:
        raise Unavailable(f"resolver {resolver.name}: {upstream}: {exc}") from None
    except KibotosError as exc:
        exc.message = f"resolver {resolver.name}: {exc.message}"
        raise
