"""The SOCKS5 client: RFC 1928 CONNECT, with RFC 1929 username/password when the Egress
has credentials.

Small enough to write with care rather than depend on: the greeting offers exactly one
method (``0x02`` with credentials, ``0x00`` without), so a server can never talk the
client out of authenticating; every reply is read with exact lengths and checked
field by field; any deviation is a `SocksError` naming it, and the caller resets the
guest's connection (fail closed: there is no direct path to fall back to).  Bytes the
server sent after its CONNECT reply (a destination that speaks first) are returned
with the stream, never lost.
"""

from __future__ import annotations

import ipaddress
import socket
import struct

import trio

VERSION = 5
NO_AUTH = 0x00
USERNAME_PASSWORD = 0x02
NO_ACCEPTABLE = 0xFF
CONNECT = 0x01
ATYP_IPV4, ATYP_DOMAIN, ATYP_IPV6 = 0x01, 0x03, 0x04
#: RFC 1928 section 6, the REP field.
REPLIES = {
    0x01: "general SOCKS server failure",
    0x02: "connection not allowed by ruleset",
    0x03: "network unreachable",
    0x04: "host unreachable",
    0x05: "connection refused",
    0x06: "TTL expired",
    0x07: "command not supported",
    0x08: "address type not supported",
}


class SocksError(Exception):
    """The SOCKS5 server refused, or broke the protocol; the message says which."""


class _Reader:
    """Exact reads from a stream, keeping what arrived beyond them."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def exactly(self, count: int, what: str) -> bytes:
        while len(self.buffer) < count:
            data = await self.stream.receive_some(65536)
            if not data:
                raise SocksError(f"the SOCKS5 server closed the connection during {what}")
            self.buffer += data
        out = bytes(self.buffer[:count])
        del self.buffer[:count]
        return out


def _destination(host: str, port: int) -> bytes:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            name = host.encode("ascii")
        except UnicodeEncodeError:
            raise SocksError(f"destination name {host!r} is not ASCII") from None
        if not 1 <= len(name) <= 255:
            raise SocksError(f"destination name {host!r} is not 1-255 bytes") from None
        return bytes([ATYP_DOMAIN, len(name)]) + name + struct.pack("!H", port)
    kind = ATYP_IPV4 if address.version == 4 else ATYP_IPV6
    return bytes([kind]) + address.packed + struct.pack("!H", port)


async def _authenticate(stream: trio.abc.Stream, reader: _Reader, username: str,
                        password: str) -> None:
    user, secret = username.encode(), password.encode()
    if not (1 <= len(user) <= 255 and 1 <= len(secret) <= 255):
        raise SocksError("a SOCKS5 username and password are 1-255 bytes each")
    await stream.send_all(bytes([0x01, len(user)]) + user + bytes([len(secret)]) + secret)
    version, status = await reader.exactly(2, "authentication")
    if version != 0x01:
        raise SocksError(f"the SOCKS5 server answered authentication with version "
                         f"{version} (expected 1)")
    if status != 0x00:
        raise SocksError("the SOCKS5 server refused the username and password")


async def _read_bound(reader: _Reader) -> tuple[str, int]:
    (kind,) = await reader.exactly(1, "the CONNECT reply")
    if kind == ATYP_IPV4:
        host = socket.inet_ntop(socket.AF_INET, await reader.exactly(4, "the CONNECT reply"))
    elif kind == ATYP_IPV6:
        host = socket.inet_ntop(socket.AF_INET6, await reader.exactly(16, "the CONNECT reply"))
    elif kind == ATYP_DOMAIN:
        (length,) = await reader.exactly(1, "the CONNECT reply")
        host = (await reader.exactly(length, "the CONNECT reply")).decode("ascii", "replace")
    else:
        raise SocksError(f"the SOCKS5 server's CONNECT reply has address type {kind}")
    (port,) = struct.unpack("!H", await reader.exactly(2, "the CONNECT reply"))
    return host, port


async def connect(stream: trio.abc.Stream, host: str, port: int, *,
                  username: str | None = None, password: str | None = None,
                  ) -> tuple[tuple[str, int], bytes]:
    """Ask the SOCKS5 server on `stream` to CONNECT to ``host:port``.

    Returns the server's bound address and the bytes it sent after its reply (the
    destination's first bytes, if any).  Raises `SocksError` on any refusal or
    protocol error; the caller puts its own deadline around this.
    """
    if (username is None) != (password is None):
        raise SocksError("a username needs a password and the other way round")
    method = NO_AUTH if username is None else USERNAME_PASSWORD
    reader = _Reader(stream)
    await stream.send_all(bytes([VERSION, 1, method]))
    version, chosen = await reader.exactly(2, "the method selection")
    if version != VERSION:
        raise SocksError(f"the server answered with SOCKS version {version}, not 5")
    if chosen == NO_ACCEPTABLE:
        raise SocksError("the SOCKS5 server accepts none of the offered methods ("
                         + ("username/password" if username is not None else "no "
                            "authentication") + ")")
    if chosen != method:
        raise SocksError(f"the SOCKS5 server chose method {chosen:#04x}, which was not "
                         "offered")
    if username is not None and password is not None:
        await _authenticate(stream, reader, username, password)
    await stream.send_all(bytes([VERSION, CONNECT, 0x00]) + _destination(host, port))
    version, reply, reserved = await reader.exactly(3, "the CONNECT reply")
    if version != VERSION:
        raise SocksError(f"the CONNECT reply has SOCKS version {version}, not 5")
    if reply != 0x00:
        raise SocksError(f"the SOCKS5 server refused CONNECT to {host}:{port}: "
                         f"{REPLIES.get(reply, f'reply {reply:#04x}')}")
    if reserved != 0x00:
        raise SocksError("the CONNECT reply's reserved byte is not zero")
    bound = await _read_bound(reader)
    return bound, bytes(reader.buffer)
