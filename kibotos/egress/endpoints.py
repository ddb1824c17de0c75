"""``host:port`` of a SOCKS5 server (an Egress's ``address``) or a DNS upstream (a
Resolver's ``upstream``, whose port may be left out: 53).

A host is an IPv4 address, an IPv6 address (in brackets when a port follows; a bare
IPv6 address is taken whole, with the default port) or a DNS name, which the egress
process resolves with the node's resolver list (`kibotos.egress.upstream`), never
with ``/etc/resolv.conf``.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from kibotos.core.errors import InvalidArgument

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def is_address(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _port(text: str, what: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise InvalidArgument(f"{what}: port {text!r} is not a number in 1-65535")
    return int(text)


def _host(text: str, what: str) -> str:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    name = text.rstrip(".")
    if not name or len(name) > 253 or not all(_LABEL.fullmatch(p) for p in name.split(".")):
        raise InvalidArgument(f"{what}: {text!r} is neither an IP address nor a host name")
    return name.lower()


def parse_endpoint(text: object, what: str, *, default_port: int | None = None) -> Endpoint:
    """`text` as an `Endpoint`; InvalidArgument naming `what` when it is not one (or
    has no port and `default_port` is None)."""
    if not isinstance(text, str) or not text:
        raise InvalidArgument(f"{what} must be a non-empty string, got {text!r}")
    if text.startswith("["):
        inner, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise InvalidArgument(f"{what}: {text!r} is not [IPv6 address]:port")
        try:
            host = str(ipaddress.IPv6Address(inner))
        except ValueError:
            raise InvalidArgument(f"{what}: {inner!r} is not an IPv6 address") from None
        port_text = rest[1:]
    elif text.count(":") > 1:  # a bare IPv6 address
        host, port_text = _host(text, what), ""
    else:
        name, _, port_text = text.partition(":")
        host = _host(name, what)
        if ":" in text and not port_text:
            raise InvalidArgument(f"{what}: {text!r} has an empty port")
    if port_text:
        return Endpoint(host, _port(port_text, what))
    if default_port is None:
        raise InvalidArgument(f"{what}: {text!r} has no port (expected host:port)")
    return Endpoint(host, default_port)
