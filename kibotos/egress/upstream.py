"""Host names of SOCKS5 servers and DNS upstreams, resolved with the node's resolver
list in order, never with the host's ``/etc/resolv.conf`` (spec: "Egress processes").

The deployment's resolvers are what the node's ``[network] resolvers`` names; the host
may use others (or none that answers) for itself.  Each name is asked of the first
resolver (A and AAAA over UDP); the next is asked only when one fails (no answer in
time, SERVFAIL, a malformed reply), not when it answers that the name does not exist.
Answers are kept for their TTL (at least `MIN_TTL`, at most `MAX_TTL` seconds).

`open_tcp` then connects to the addresses in order (IPv4 first), so a caller never
goes through ``getaddrinfo`` with a name.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
from collections.abc import Sequence

import trio

from kibotos.core.errors import NotFound, Unavailable
from kibotos.core.logs import EventLogger
from kibotos.egress import dns_wire

log = EventLogger("kibotos.egress")

QUERY_TIMEOUT = 2.0
MIN_TTL, MAX_TTL = 5, 300


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def _ask(resolver: str, name: str, qtype: int, timeout: float) -> dns_wire.Answer:
    family = socket.AF_INET6 if ":" in resolver else socket.AF_INET
    qid = secrets.randbits(16)
    query = dns_wire.build_query(name, qtype, qid)
    with trio.socket.socket(family, socket.SOCK_DGRAM) as sock, trio.fail_after(timeout):
        await sock.connect((resolver, 53))  # only the resolver's replies arrive
        await sock.send(query)
        while True:
            reply = await sock.recv(dns_wire.MAX_MESSAGE)
            try:
                return dns_wire.parse_answer(reply, qid, qtype)
            except dns_wire.DnsFormatError:
                continue  # not the answer to this query: keep waiting until the deadline


class NameResolver:
    """Resolves with `resolvers` (addresses, in order); see the module docstring."""

    def __init__(self, resolvers: Sequence[str], *, timeout: float = QUERY_TIMEOUT) -> None:
        self.resolvers = tuple(resolvers)
        self.timeout = timeout
        self._cache: dict[str, tuple[float, tuple[str, ...]]] = {}

    async def addresses(self, host: str) -> tuple[str, ...]:
        if _is_address(host):
            return (host,)
        cached = self._cache.get(host)
        if cached is not None and cached[0] > trio.current_time():
            return cached[1]
        if not self.resolvers:
            raise Unavailable(f"cannot resolve {host}: the node has no [network] resolvers")
        problems = []
        for resolver in self.resolvers:
            try:
                answers = [await _ask(resolver, host, qtype, self.timeout)
                           for qtype in (dns_wire.TYPE_A, dns_wire.TYPE_AAAA)]
            except (trio.TooSlowError, OSError, dns_wire.DnsFormatError) as exc:
                problems.append(f"{resolver}: {type(exc).__name__} {exc}".strip())
                continue
            if any(a.rcode not in (dns_wire.RCODE_NOERROR, dns_wire.RCODE_NXDOMAIN)
                   for a in answers):
                problems.append(f"{resolver}: rcode {max(a.rcode for a in answers)}")
                continue
            found = tuple(a for answer in answers for a in answer.addresses)
            if not found:
                raise NotFound(f"{host} has no address (asked {resolver})")
            ttl = min(max(min(a.ttl for a in answers if a.addresses), MIN_TTL), MAX_TTL)
            self._cache[host] = (trio.current_time() + ttl, found)
            return found
        raise Unavailable(f"cannot resolve {host}: no resolver answered "
                          f"({'; '.join(problems)})")

    async def open_tcp(self, host: str, port: int) -> trio.SocketStream:
        """A TCP connection to the first address of `host` that accepts one."""
        addresses = sorted(await self.addresses(host), key=lambda a: ":" in a)
        failures = []
        for address in addresses:
            try:
                return await trio.open_tcp_stream(address, port)
            except OSError as exc:
                failures.append(f"{address}: {exc.strerror or exc}")
        raise Unavailable(f"cannot connect to {host}:{port} ({'; '.join(failures)})")
