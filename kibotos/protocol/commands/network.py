"""A Workspace's network policy as ctrl sends it to the node (``instance.create``'s
``network``, ``instance.set_network``), with its Egress and Resolver references
(docs/network.md).

The policy is E2B's model: `public_egress` on or off; `allow_out` / `deny_out` lists
of CIDRs or addresses (with no `allow_out`, everything not denied is allowed; an
address in both is allowed); an optional `egress` (a caller's SOCKS5 endpoint, by name
and revision: the node fetches its credentials from ctrl with its own identity, so no
secret travels in a command) and an optional `resolver` (a DNS upstream, direct or
through that Egress).  CIDRs are checked and kept in their canonical text here, once,
for ctrl's HTTP requests and the node alike.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import AfterValidator, Field, StrictBool, StrictStr, model_validator

from kibotos.core import cidrs
from kibotos.protocol.commands.base import Args, Part
from kibotos.protocol.ids import InstanceId, TemplateName
from kibotos.protocol.values import Revision

#: The largest allow_out / deny_out list (one nftables set element each).
MAX_CIDRS = 512
#: ``host:port`` or ``[v6]:port`` of a SOCKS5 endpoint or DNS upstream.
MAX_ENDPOINT = 255


def _cidr(value: str) -> str:
    """Canonical text (``10.0.0.1`` → ``10.0.0.1/32``); host bits set is an error."""
    return str(cidrs.parse_network(value))


Cidr = Annotated[StrictStr, Field(max_length=64), AfterValidator(_cidr)]
#: Egress and Resolver names follow the Template name rule (1-63 lowercase letters,
#: digits, ``-`` and ``.``, not starting or ending with a separator).
EgressName = TemplateName
ResolverName = TemplateName
Endpoint = Annotated[StrictStr, Field(min_length=1, max_length=MAX_ENDPOINT)]


class EgressRef(Part):
    """An Egress by name and the revision whose credentials the node must use."""

    name: EgressName
    revision: Revision
    #: Where the SOCKS5 server listens: ``host:port`` (a host name or an address).
    address: Endpoint
    #: Whether the Egress has a username and password (fetched from ctrl by revision).
    authenticated: StrictBool = False


class ResolverRef(Part):
    """A Resolver: where the guest's DNS queries go, direct or through the Egress."""

    name: ResolverName
    revision: Revision
    #: ``address[:port]`` or ``host[:port]``; port 53 when absent.
    upstream: Endpoint
    via_egress: StrictBool = False


class NetworkPolicy(Part):
    """What a guest may reach; the node's slot table enforces it."""

    public_egress: StrictBool = True
    allow_out: Annotated[list[Cidr], Field(max_length=MAX_CIDRS)] = Field(default_factory=list)
    deny_out: Annotated[list[Cidr], Field(max_length=MAX_CIDRS)] = Field(default_factory=list)
    egress: EgressRef | None = None
    resolver: ResolverRef | None = None

    @model_validator(mode="after")
    def _resolver_egress(self) -> NetworkPolicy:
        if self.resolver is not None and self.resolver.via_egress and self.egress is None:
            raise ValueError("a resolver via the egress needs the policy's egress")
        return self


class SetNetworkArgs(Args):
    """``instance.set_network``: a network switch of a running Instance, applied by the
    node in one nftables transaction; `revision` orders switches (an older one than the
    node has applied is refused)."""

    KIND: ClassVar[str] = "instance.set_network"

    instance_id: InstanceId
    network: NetworkPolicy
    revision: Revision
