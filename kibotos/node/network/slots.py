"""Slots: which addresses of the pools an Instance gets.

Slot ``n`` is the ``n``-th block of four addresses of each pool, split in two
point-to-point links (/31 for IPv4, /127 for IPv6, RFC 3021 and RFC 6164)::

    block+0  host end of the veth      (kbv…, in the host namespace)
    block+1  namespace end of the veth (veth0, in the Instance namespace)
    block+2  the guest's gateway       (tap0, in the Instance namespace; also its DNS)
    block+3  the guest                 (the VM's interface)

The slot chosen is the lowest one no record holds: deterministic for a given set of
records, so a retry after a crash before the record was written picks the same one, and
once recorded adoption reads the addresses from the record, never recomputes them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kibotos.core.errors import InvalidArgument, ResourceExhausted
from kibotos.network_config import SLOT_SIZE, NetworkSection

PREFIX4 = 31
PREFIX6 = 127


@dataclass(frozen=True)
class LinkAddresses:
    """The four addresses of one family in a slot."""

    host: ipaddress.IPv4Address | ipaddress.IPv6Address
    ns: ipaddress.IPv4Address | ipaddress.IPv6Address
    gateway: ipaddress.IPv4Address | ipaddress.IPv6Address
    guest: ipaddress.IPv4Address | ipaddress.IPv6Address

    @property
    def prefix(self) -> int:
        return PREFIX4 if self.host.version == 4 else PREFIX6

    def to_record(self) -> dict[str, str]:
        return {"host": str(self.host), "ns": str(self.ns), "gateway": str(self.gateway),
                "guest": str(self.guest)}

    @classmethod
    def from_record(cls, value: Any, family: int) -> LinkAddresses:
        if not isinstance(value, dict) or set(value) != {"host", "ns", "gateway", "guest"}:
            raise InvalidArgument(f"malformed IPv{family} slot addresses {value!r}")
        parsed = {k: ipaddress.ip_address(v) for k, v in value.items()}
        if any(a.version != family for a in parsed.values()):
            raise InvalidArgument(f"IPv{family} slot addresses of another family: {value!r}")
        return cls(**parsed)


@dataclass(frozen=True)
class SlotAddresses:
    index: int
    v4: LinkAddresses
    v6: LinkAddresses | None

    def families(self) -> list[LinkAddresses]:
        return [self.v4, *([self.v6] if self.v6 is not None else [])]

    def to_record(self) -> dict[str, Any]:
        return {"index": self.index, "v4": self.v4.to_record(),
                "v6": None if self.v6 is None else self.v6.to_record()}

    @classmethod
    def from_record(cls, value: Any) -> SlotAddresses:
        if not isinstance(value, dict) or not isinstance(value.get("index"), int):
            raise InvalidArgument(f"malformed slot {value!r}")
        v6 = value.get("v6")
        return cls(index=value["index"], v4=LinkAddresses.from_record(value.get("v4"), 4),
                   v6=None if v6 is None else LinkAddresses.from_record(v6, 6))


def _block(pool: ipaddress.IPv4Network | ipaddress.IPv6Network, index: int) -> LinkAddresses:
    base = pool.network_address + SLOT_SIZE * index
    return LinkAddresses(host=base, ns=base + 1, gateway=base + 2, guest=base + 3)


def slot_addresses(config: NetworkSection, index: int) -> SlotAddresses:
    if not 0 <= index < config.slot_count:
        raise InvalidArgument(f"slot {index} is outside the pools ({config.slot_count} slots)")
    pool6 = config.pool6
    return SlotAddresses(index=index, v4=_block(config.pool4, index),
                         v6=None if pool6 is None else _block(pool6, index))


def lowest_free(taken: Iterable[int], count: int) -> int:
    used = set(taken)
    for index in range(count):
        if index not in used:
            return index
    raise ResourceExhausted(f"every one of the {count} network slots of this node is in use "
                            "(grow ipv4_pool/ipv6_pool in [network])")
