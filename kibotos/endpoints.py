"""``HOST:PORT`` endpoints as operators write them (an Egress's SOCKS5 address, a
Resolver's DNS upstream), parsed strictly and kept in one canonical text.

Strict because an endpoint ends up as a connection target on every node: a port of
Unicode digits (``'٥٣'`` passes ``str.isdigit``), a leading zero that some tools read
as octal, an address with a zone or a host name with spaces would each mean something
different to the next program that reads it.  So:

* a port is 1-65535 in ASCII digits, no sign, no leading zero;
* a host is an IPv4 address, an IPv6 address in brackets (bare only where no port
  follows), or a DNS name of ASCII letters, digits and hyphens (labels of 1-63, at
  most 253 in all, lowercased; a last label of digits only is refused: it is a
  mistyped address, not a name);
* the unspecified and multicast addresses are refused: nothing can be reached there.

The canonical text is ``host:port``, ``[v6]:port`` for IPv6, with the address in its
compressed form and the name in lowercase.  Errors are `ValueError` whose message
starts with `what` (when given), for the CLI to name the option; pydantic names the
field itself.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

_PORT = re.compile(r"[1-9][0-9]{0,4}")
_DOTTED = re.compile(r"[0-9.]+")
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
MAX_NAME = 253


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    #: The host is an IP address (not a name to resolve).
    is_address: bool

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def _lead(what: str) -> str:
    return f"{what}: " if what else ""


def _port(text: str, what: str) -> int:
    if not _PORT.fullmatch(text) or int(text) > 65535:
        raise ValueError(f"{_lead(what)}port {text!r} is not 1-65535 in ASCII digits "
                         "(no sign, no leading zero)")
    return int(text)


def _address(text: str, what: str) -> str:
    if "%" in text:
        raise ValueError(f"{_lead(what)}{text!r}: an address with a zone (%...) means "
                         "something else on every host")
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        raise ValueError(f"{_lead(what)}{text!r} is not an IP address") from None
    if address.is_unspecified or address.is_multicast:
        raise ValueError(f"{_lead(what)}{text!r} is an unspecified or multicast address: "
                         "nothing can be reached there")
    return str(address)


def _name(text: str, what: str) -> str:
    name = text.lower()
    labels = name.split(".")
    if (not name.isascii() or len(name) > MAX_NAME
            or not all(_LABEL.fullmatch(label) for label in labels)):
        raise ValueError(f"{_lead(what)}{text!r} is neither an IP address nor a host name "
                         "(labels of ASCII letters, digits and '-', separated by '.')")
    if labels[-1].isdigit():
        raise ValueError(f"{_lead(what)}{text!r} is not a valid IP address, and a host name "
                         "does not end in digits only")
    return name


def _host(text: str, what: str) -> tuple[str, bool]:
    if not text:
        raise ValueError(f"{_lead(what)}the host is empty")
    if _DOTTED.fullmatch(text):
        return _address(text, what), True
    if ":" in text:
        return _address(text, what), True
    return _name(text, what), False


def parse(value: object, what: str, *, default_port: int | None = None) -> Endpoint:
    """`value` as an endpoint.  Without `default_port` the port is required
    (``HOST:PORT``); with it, ``HOST`` alone (or a bare IPv6 address) takes that port."""
    if not isinstance(value, str):
        raise ValueError(f"{_lead(what)}expected a string, got {type(value).__name__}")
    text = value
    if text != text.strip() or any(c.isspace() for c in text):
        raise ValueError(f"{_lead(what)}{value!r} contains white space")
    port_text: str | None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or ":" not in host:
            raise ValueError(f"{_lead(what)}{value!r}: brackets hold an IPv6 address, "
                             "as in [2001:db8::1]:1080")
        if rest and not rest.startswith(":"):
            raise ValueError(f"{_lead(what)}{value!r}: expected ':PORT' after the bracket")
        port_text = rest[1:] if rest else None
        if rest and not port_text:
            raise ValueError(f"{_lead(what)}{value!r}: the port is empty")
    elif text.count(":") > 1:
        if default_port is None:
            raise ValueError(f"{_lead(what)}{value!r}: write an IPv6 address in brackets, "
                             "as in [2001:db8::1]:1080")
        host, port_text = text, None
    else:
        host, sep, port_text = text.partition(":")
        if not sep:
            port_text = None
        elif not port_text:
            raise ValueError(f"{_lead(what)}{value!r}: the port is empty")
    name, is_address = _host(host, what)
    if port_text is None:
        if default_port is None:
            raise ValueError(f"{_lead(what)}{value!r} has no port: expected HOST:PORT")
        return Endpoint(name, default_port, is_address)
    return Endpoint(name, _port(port_text, what), is_address)


def canonical(value: object, what: str, *, default_port: int | None = None) -> str:
    """`parse`'s endpoint as its canonical text."""
    return str(parse(value, what, default_port=default_port))
