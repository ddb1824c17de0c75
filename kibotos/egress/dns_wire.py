"""The little of the DNS message format (RFC 1035) the egress process needs.

Forwarding a guest's query needs nothing but its ID, its flags and TCP's two-byte
length prefix: the message goes to the upstream as it came.  Resolving an upstream's
or SOCKS5 server's host name (`kibotos.egress.upstream`) needs a query for one name
and type and the addresses of an answer; names in answers may be compressed, which
`_skip_name` follows without ever reading outside the message.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

TYPE_A, TYPE_AAAA, CLASS_IN = 1, 28, 1
RCODE_NOERROR, RCODE_SERVFAIL, RCODE_NXDOMAIN = 0, 2, 3
FLAG_QR, FLAG_TC, FLAG_RD = 0x8000, 0x0200, 0x0100
HEADER = 12
MAX_MESSAGE = 65535


class DnsFormatError(ValueError):
    """A message too short or malformed to use."""


def message_id(message: bytes) -> int:
    if len(message) < HEADER:
        raise DnsFormatError(f"a DNS message of {len(message)} bytes has no header")
    return int(struct.unpack_from("!H", message)[0])


def flags(message: bytes) -> int:
    if len(message) < HEADER:
        raise DnsFormatError(f"a DNS message of {len(message)} bytes has no header")
    return int(struct.unpack_from("!H", message, 2)[0])


def is_query(message: bytes) -> bool:
    return len(message) >= HEADER and not flags(message) & FLAG_QR


def with_id(message: bytes, qid: int) -> bytes:
    return struct.pack("!H", qid) + message[2:]


def framed(message: bytes) -> bytes:
    """The message with TCP's length prefix (RFC 1035 4.2.2)."""
    if len(message) > MAX_MESSAGE:
        raise DnsFormatError(f"a DNS message of {len(message)} bytes does not fit TCP's "
                             "length prefix")
    return struct.pack("!H", len(message)) + message


def encode_name(name: str) -> bytes:
    labels = [p for p in name.rstrip(".").split(".") if p]
    out = b""
    for label in labels:
        try:
            raw = label.encode("ascii")
        except UnicodeEncodeError:
            raise DnsFormatError(f"name {name!r} is not ASCII (use its xn-- form)") from None
        if not 1 <= len(raw) <= 63:
            raise DnsFormatError(f"label {label!r} of {name!r} is not 1-63 bytes")
        out += bytes([len(raw)]) + raw
    if len(out) + 1 > 255:
        raise DnsFormatError(f"name {name!r} is longer than 255 bytes")
    return out + b"\0"


def build_query(name: str, qtype: int, qid: int) -> bytes:
    """A recursive query for `name` and `qtype` (class IN)."""
    return (struct.pack("!HHHHHH", qid, FLAG_RD, 1, 0, 0, 0) + encode_name(name)
            + struct.pack("!HH", qtype, CLASS_IN))


def _skip_name(message: bytes, offset: int) -> int:
    """The offset after the name at `offset` (a pointer ends a name)."""
    for _ in range(128):
        if offset >= len(message):
            raise DnsFormatError("a name runs past the end of the message")
        length = message[offset]
        if length & 0xC0 == 0xC0:
            if offset + 2 > len(message):
                raise DnsFormatError("a name pointer runs past the end of the message")
            return offset + 2
        if length & 0xC0:
            raise DnsFormatError(f"label type {length >> 6} is not supported")
        offset += 1 + length
        if length == 0:
            return offset
    raise DnsFormatError("a name has too many labels")


@dataclass(frozen=True)
class Answer:
    rcode: int
    addresses: tuple[str, ...]
    ttl: int  # the smallest TTL of the address records; 0 without any


def parse_answer(message: bytes, qid: int, qtype: int) -> Answer:
    """The addresses of type `qtype` in the answer to query `qid`."""
    if len(message) < HEADER:
        raise DnsFormatError("the answer has no header")
    rid, bits, qdcount, ancount, _, _ = struct.unpack_from("!HHHHHH", message)
    if rid != qid or not bits & FLAG_QR:
        raise DnsFormatError("the message is not the answer to this query")
    offset = HEADER
    for _ in range(qdcount):
        offset = _skip_name(message, offset) + 4
    found: list[str] = []
    ttls: list[int] = []
    size = 4 if qtype == TYPE_A else 16
    for _ in range(ancount):
        offset = _skip_name(message, offset)
        if offset + 10 > len(message):
            raise DnsFormatError("a record runs past the end of the message")
        rtype, rclass, ttl, length = struct.unpack_from("!HHIH", message, offset)
        offset += 10
        data = message[offset:offset + length]
        if len(data) != length:
            raise DnsFormatError("a record's data runs past the end of the message")
        offset += length
        if rtype == qtype and rclass == CLASS_IN and length == size:
            found.append(str(ipaddress.ip_address(data)))
            ttls.append(ttl)
    return Answer(rcode=bits & 0x000F, addresses=tuple(found), ttl=min(ttls, default=0))
