"""A Workspace's network policy as the node enforces it, and whether this node can.

Semantics (E2B's): a destination in `allow_out` is allowed; otherwise one in `deny_out`
is dropped; otherwise it is allowed when public egress is on.  So with no `allow_out`
everything not denied is allowed, an address in both lists is allowed, and "only these"
is ``deny_out = ["0.0.0.0/0", "::/0"]`` plus the allowed ones.  With public egress off
a guest reaches nothing directly (only DNS through the node), and the lists have
nothing to act on.

Whatever the policy says, a guest never reaches the management CIDRs, the host's own
addresses, the other Instances (the pools), and the ranges in `cidrs.NEVER_REACHABLE_4`
and ``_6``: those drops come before the allow list.

An `egress` (a caller's SOCKS5 server, by name and revision) takes the guest's TCP:
the slot table redirects it to the egress process, which tunnels it through the
SOCKS5 server, whatever `public_egress` says (the lists and the never-reachable
ranges still apply to the destination).  A `resolver` takes the guest's DNS: the
egress process answers on the gateway's port 53 instead of the kernel forwarding to
the deployment resolver.  The references carry no secret (`kibotos.protocol`'s
`EgressRef` and `ResolverRef`).
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kibotos import cidrs
from kibotos.errors import InvalidArgument
from kibotos.network_config import NetworkSection
from kibotos.protocol.commands.network import EgressRef, ResolverRef

#: The largest allow_out/deny_out list accepted (a set element each; kept small so a
#: table stays quick to write and read back).
MAX_ENTRIES = 512


class NetworkPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    public_egress: bool = True
    allow_out: list[str] = Field(default_factory=list, max_length=MAX_ENTRIES)
    deny_out: list[str] = Field(default_factory=list, max_length=MAX_ENTRIES)
    egress: EgressRef | None = None
    resolver: ResolverRef | None = None

    @field_validator("allow_out", "deny_out")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        return [str(cidrs.parse_network(c, f"entry {i}")) for i, c in enumerate(v)]

    @model_validator(mode="after")
    def _resolver_egress(self) -> NetworkPolicy:
        if self.resolver is not None and self.resolver.via_egress and self.egress is None:
            raise ValueError("a resolver via the egress needs the policy's egress")
        return self

    def allowed(self, family: cidrs.Family) -> list[cidrs.Network]:
        return cidrs.of_family((_net(c) for c in self.allow_out), family)

    def denied(self, family: cidrs.Family) -> list[cidrs.Network]:
        return cidrs.of_family((_net(c) for c in self.deny_out), family)

    def to_record(self) -> dict[str, Any]:
        """The record's form; a policy without an egress or resolver is written as
        before they existed, so its record (and what reads it) does not change."""
        value = self.model_dump()
        for key in ("egress", "resolver"):
            if value[key] is None:
                del value[key]
        return value


def _net(value: str) -> cidrs.Network:
    return cidrs.parse_network(value, "policy entry")


def parse_policy(value: object) -> NetworkPolicy:
    """A policy from a request or a record; InvalidArgument naming the bad field."""
    if not isinstance(value, dict):
        raise InvalidArgument(f"network policy must be an object, got {type(value).__name__}")
    try:
        return NetworkPolicy.model_validate(value)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            parts.append(f"{loc}: {msg.removeprefix('Value error, ')}")
        raise InvalidArgument(f"invalid network policy: {'; '.join(parts)}") from None


def why_not_enforceable(recorded: object, config: NetworkSection) -> str | None:
    """Why this node cannot enforce a recorded policy (a policy written by another
    version, or one the node's config no longer supports), or None when it can."""
    try:
        policy = parse_policy(recorded)
    except InvalidArgument as exc:
        return f"this version cannot read the recorded policy ({exc.message})"
    if policy.public_egress and not config.public_egress:
        return "the policy asks for public egress and this node no longer provides it"
    return None
