"""The sockets the node hands to the egress process, by role, and what the process
asks of them: the original destination of a redirected guest connection, and a reset.

Each Instance whose policy has an Egress gets a TCP listener per address family in its
own network namespace, on its gateway address and `kibotos.node.network.names`'s
``EGRESS_PORT``; the slot table redirects (nftables ``redirect``, a DNAT to the
gateway) the guest's outgoing TCP there.  An Instance with a Resolver gets a UDP socket
and a TCP listener on its gateway's port 53 per family.  The node creates them inside
the namespace (the egress process cannot enter it, and needs no privilege for them
afterwards) and hands them over by role.

Why ``redirect`` and ``SO_ORIGINAL_DST``, not TPROXY and the local address: the
listener lives in the Instance's namespace, where the slot table's NAT is recorded, so
conntrack answers ``SO_ORIGINAL_DST`` exactly, and nothing needs ``IP_TRANSPARENT``,
policy routing or marks.  A listener in the host namespace would see the connection
only after it crossed the veth, and the host's conntrack knows nothing of the
Instance namespace's NAT; marks do not survive the veth either (the kernel scrubs them
between namespaces).
"""

from __future__ import annotations

import contextlib
import socket
import struct
from typing import Protocol

from kibotos.core.errors import InvalidArgument


class _Socket(Protocol):
    """A stdlib or a trio socket."""

    @property
    def family(self) -> int: ...

    def getsockopt(self, level: int, option: int, size: int, /) -> bytes: ...

#: The role of each socket, and what it is: (family, type).
ROLES: dict[str, tuple[int, int]] = {
    "tcp4": (socket.AF_INET, socket.SOCK_STREAM),
    "tcp6": (socket.AF_INET6, socket.SOCK_STREAM),
    "dns-udp4": (socket.AF_INET, socket.SOCK_DGRAM),
    "dns-udp6": (socket.AF_INET6, socket.SOCK_DGRAM),
    "dns-tcp4": (socket.AF_INET, socket.SOCK_STREAM),
    "dns-tcp6": (socket.AF_INET6, socket.SOCK_STREAM),
}
EGRESS_ROLES = ("tcp4", "tcp6")
DNS_ROLES = ("dns-udp4", "dns-udp6", "dns-tcp4", "dns-tcp6")
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h; IP6T_SO_ORIGINAL_DST has the same number
SIOCGSKNS = 0x894C  # linux/sockios.h: the network namespace of a socket, as a descriptor
#: ``setsockopt`` arguments that make the next close a TCP reset.
SO_LINGER_RESET = (socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def roles_for(*, egress: bool, resolver: bool, v6: bool) -> list[str]:
    """The roles an Instance needs for its policy and address families."""
    families = ("4", "6") if v6 else ("4",)
    roles = [f"tcp{f}" for f in families] if egress else []
    if resolver:
        roles += [f"dns-{kind}{f}" for kind in ("udp", "tcp") for f in families]
    return roles


def check_role(role: object) -> str:
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidArgument(f"unknown socket role {role!r} (known: {', '.join(ROLES)})")
    return role


def matches_role(sock: socket.socket, role: str) -> bool:
    family, kind = ROLES[role]
    return sock.family == family and sock.type == kind


def original_destination(sock: _Socket) -> tuple[str, int]:
    """Where the guest meant to connect, before the slot table redirected it."""
    if sock.family == socket.AF_INET:
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        (port,) = struct.unpack_from("!H", raw, 2)
        return socket.inet_ntop(socket.AF_INET, raw[4:8]), port
    raw = sock.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)
    (port,) = struct.unpack_from("!H", raw, 2)
    return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset (linger 0): the guest sees its connection refused, not a
    clean end it could mistake for a complete answer."""
    with contextlib.suppress(OSError):
        sock.setsockopt(*SO_LINGER_RESET)
    sock.close()
