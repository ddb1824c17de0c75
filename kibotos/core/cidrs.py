"""Addresses and CIDRs as the network config and policies accept them, and the ranges a
guest may never reach whatever its policy says.

One parser for both so a CIDR means the same in ``[network]`` and in a Workspace's
``allow_out``: an address or a network in CIDR form, host bits clear (``10.0.0.1/8`` is
refused rather than silently widened: it is usually a typo for ``10.0.0.1/32`` or
``10.0.0.0/8``, and guessing wrong opens or closes a whole range).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Literal

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Family = Literal[4, 6]

#: Never reachable from a guest, IPv4: "this network", loopback, link-local (and so
#: the 169.254.169.254 metadata service of most clouds), the 100.100.100.200 metadata
#: service of Alibaba Cloud, multicast, the reserved 240/4 and the limited broadcast.
NEVER_REACHABLE_4: tuple[ipaddress.IPv4Network, ...] = tuple(
    ipaddress.IPv4Network(c) for c in (
        "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "100.100.100.200/32",
        "224.0.0.0/4", "240.0.0.0/4"))
#: Never reachable from a guest, IPv6: unspecified, loopback, IPv4-mapped, link-local,
#: the fd00:ec2::254 metadata service of AWS, multicast.
NEVER_REACHABLE_6: tuple[ipaddress.IPv6Network, ...] = tuple(
    ipaddress.IPv6Network(c) for c in (
        "::/128", "::1/128", "::ffff:0:0/96", "fe80::/10", "fd00:ec2::254/128", "ff00::/8"))


def parse_network(value: object, what: str = "") -> Network:
    """`value` as a network: an address (a /32 or /128) or a CIDR with its host bits
    clear.  Raises ValueError, its message starting with `what` when given."""
    lead = f"{what}: " if what else ""
    if not isinstance(value, str):
        raise ValueError(f"{lead}expected a CIDR or an IP address as a string, "
                         f"got {type(value).__name__}")
    try:
        return ipaddress.ip_network(value, strict=True)
    except ValueError:
        pass
    try:
        wide = ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise ValueError(f"{lead}{value!r} is not an IP address or a CIDR") from None
    address = value.split("/", 1)[0]
    raise ValueError(f"{lead}{value!r} has host bits set (did you mean {wide} or "
                     f"{address}/{wide.max_prefixlen}?)")


def parse_address(value: object, what: str) -> Address:
    if not isinstance(value, str):
        raise ValueError(f"{what}: expected an IP address as a string, "
                         f"got {type(value).__name__}")
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{what}: {value!r} is not an IP address") from None


def of_family(networks: Iterable[Network], family: Family) -> list[Network]:
    """The networks of one family, collapsed and sorted: the canonical form two sets of
    CIDRs are compared in (nftables merges adjacent elements of an interval set)."""
    chosen = [n for n in networks if n.version == family]
    return list(ipaddress.collapse_addresses(chosen))  # type: ignore[type-var]


def overlapping(a: Iterable[Network], b: Iterable[Network]) -> list[tuple[Network, Network]]:
    """Every pair of one network of `a` and one of `b` that share an address."""
    bs = list(b)
    return [(x, y) for x in a for y in bs if x.version == y.version and x.overlaps(y)]
