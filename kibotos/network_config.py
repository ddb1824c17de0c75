"""``[network]`` of the node config: the guest address pools, what guests never reach,
the uplink, and the deployment resolvers (docs/network.md).  It sits in the core beside
`kibotos.config`, not in `kibotos.node.network`, because ctrl loads the config module
too and must not import the node role.

Without the section a node gives its Instances no network at all (as before networking
existed); with it every Instance gets a slot from the pools.  Values are checked, never
coerced: a CIDR with host bits, an address where a list is expected or ``"yes"`` for a
boolean is an error that names the key, and nothing is written.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kibotos.core import cidrs

#: A slot is four addresses (two /31 or /127 links: host<->namespace, namespace<->guest).
SLOT_SIZE = 4
#: Linux interface names: at most 15 bytes, no '/', ':' or white space.
_IFNAME = re.compile(r"[A-Za-z0-9_.-]{1,15}")


class NetworkSection(BaseModel):
    """The node's network.  `uplink` is an interface name (masquerade to whatever
    address it has) or one of the host's addresses (SNAT to it)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    ipv4_pool: str
    ipv6_pool: str | None = None
    management_cidrs: list[str] = Field(default_factory=list)
    uplink: str = ""
    public_egress: bool = False
    resolvers: list[str] = Field(default_factory=list)

    @field_validator("ipv4_pool")
    @classmethod
    def _pool4(cls, v: str) -> str:
        return str(_pool(v, 4))

    @field_validator("ipv6_pool")
    @classmethod
    def _pool6(cls, v: str | None) -> str | None:
        return None if v is None else str(_pool(v, 6))

    @field_validator("management_cidrs")
    @classmethod
    def _management(cls, v: list[str]) -> list[str]:
        return [str(cidrs.parse_network(c, f"management_cidrs[{i}]")) for i, c in enumerate(v)]

    @field_validator("uplink")
    @classmethod
    def _uplink(cls, v: str) -> str:
        if not v:
            return v
        try:
            address = ipaddress.ip_address(v)
        except ValueError:
            if not _IFNAME.fullmatch(v):
                raise ValueError(f"{v!r} is neither an IP address nor an interface name "
                                 "(1-15 letters, digits, '_', '.', '-')") from None
            return v
        if address.is_loopback or address.is_unspecified or address.is_multicast:
            raise ValueError(f"{v!r} cannot carry public egress")
        return str(address)

    @field_validator("resolvers")
    @classmethod
    def _resolvers(cls, v: list[str]) -> list[str]:
        out = []
        for i, value in enumerate(v):
            address = cidrs.parse_address(value, f"resolvers[{i}]")
            if address.is_loopback or address.is_unspecified or address.is_multicast:
                # a guest's queries leave its own namespace: a loopback resolver is the
                # namespace's, not the host's, and answers nothing
                raise ValueError(f"resolvers[{i}]: {value!r} is not reachable from a guest's "
                                 "network namespace (loopback, unspecified or multicast)")
            out.append(str(address))
        if len(set(out)) != len(out):
            raise ValueError("a resolver is listed twice")
        return out

    @model_validator(mode="after")
    def _coherent(self) -> NetworkSection:
        if self.public_egress and not self.uplink:
            raise ValueError("public_egress = true needs an uplink (interface or address)")
        pools: list[cidrs.Network] = [self.pool4]
        if self.pool6 is not None:
            pools.append(self.pool6)
        for pool, cidr in cidrs.overlapping(pools, self.management):
            raise ValueError(f"the pool {pool} overlaps management_cidrs entry {cidr}")
        return self

    # ------------------------------------------------------------------ parsed views

    @property
    def pool4(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.ipv4_pool)

    @property
    def pool6(self) -> ipaddress.IPv6Network | None:
        return None if self.ipv6_pool is None else ipaddress.IPv6Network(self.ipv6_pool)

    @property
    def management(self) -> list[cidrs.Network]:
        return [ipaddress.ip_network(c) for c in self.management_cidrs]

    @property
    def resolver_addresses(self) -> list[cidrs.Address]:
        return [ipaddress.ip_address(r) for r in self.resolvers]

    @property
    def uplink_address(self) -> cidrs.Address | None:
        """The uplink when it was given as an address; None for an interface name."""
        try:
            return ipaddress.ip_address(self.uplink)
        except ValueError:
            return None

    @property
    def slot_count(self) -> int:
        """How many Instances fit: both pools hold one block of `SLOT_SIZE` per slot."""
        count = self.pool4.num_addresses // SLOT_SIZE
        if self.pool6 is not None:
            count = min(count, self.pool6.num_addresses // SLOT_SIZE)
        return count


def _pool(value: Any, family: cidrs.Family) -> cidrs.Network:
    network = cidrs.parse_network(value)
    if network.version != family:
        raise ValueError(f"{value!r} is not an IPv{family} network")
    if network.num_addresses < SLOT_SIZE:
        raise ValueError(f"{value!r} holds no slot: a slot needs {SLOT_SIZE} addresses "
                         f"(a /{network.max_prefixlen - 2} at least)")
    never = cidrs.NEVER_REACHABLE_4 if family == 4 else cidrs.NEVER_REACHABLE_6
    for reserved in cidrs.overlapping([network], never):
        raise ValueError(f"{value!r} overlaps the reserved range {reserved[1]}")
    return network
