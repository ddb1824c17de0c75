"""A Workspace's network policy as the node enforces it, and whether this node can.

The policy's fields are defined once, on the wire: `kibotos.protocol.NetworkPolicy`
(what ctrl sends in ``instance.create`` and ``instance.set_network``; its CIDRs are
checked and canonical there).  This module adds what enforcement needs: reading a
recorded policy back (`parse_policy`), the lists per address family, the record form,
whether this node version and configuration can enforce it (`why_not_enforceable`: the
slot table), and whether the node can serve its Egress or Resolver
(`why_no_egress_process`: the node's admission).

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

import ipaddress
from typing import Any

from pydantic import ValidationError

from kibotos.core import cidrs
from kibotos.core.errors import InvalidArgument
from kibotos.network_config import NetworkSection
from kibotos.protocol import NetworkPolicy
from kibotos.protocol.codec import describe
from kibotos.protocol.commands.network import MAX_CIDRS

__all__ = ["MAX_ENTRIES", "NetworkPolicy", "allowed", "denied", "needs_egress_process",
           "parse_policy", "to_record", "why_no_egress_process", "why_not_enforceable"]

#: The largest allow_out/deny_out list accepted (the wire's bound).
MAX_ENTRIES = MAX_CIDRS


def allowed(policy: NetworkPolicy, family: cidrs.Family) -> list[cidrs.Network]:
    """`allow_out` of one family, collapsed and sorted (a table set's content)."""
    return cidrs.of_family((ipaddress.ip_network(c) for c in policy.allow_out), family)


def denied(policy: NetworkPolicy, family: cidrs.Family) -> list[cidrs.Network]:
    """`deny_out` of one family, collapsed and sorted."""
    return cidrs.of_family((ipaddress.ip_network(c) for c in policy.deny_out), family)


def to_record(policy: NetworkPolicy) -> dict[str, Any]:
    """The policy as the network record keeps it (its wire form); a policy without an
    egress or resolver is written as before they existed, so its record (and what
    compares or reads it, also an older node version) does not change."""
    value = policy.model_dump(mode="json")
    for key in ("egress", "resolver"):
        if value[key] is None:
            del value[key]
    return value


def parse_policy(value: object) -> NetworkPolicy:
    """A policy from a request or a record; InvalidArgument naming the bad field."""
    if not isinstance(value, dict):
        raise InvalidArgument(f"network policy must be an object, got {type(value).__name__}")
    try:
        return NetworkPolicy.model_validate(value)
    except ValidationError as exc:
        raise InvalidArgument(f"invalid network policy: {describe(exc)}") from None


def why_not_enforceable(recorded: object, config: NetworkSection) -> str | None:
    """Why this node's slot table cannot enforce a policy (one written by another
    version, or one the node's config no longer supports), or None when it can.

    An Egress or a Resolver is enforceable here: the table steers the guest's TCP and
    DNS to the egress process's port on the gateway, and with no process listening
    there the guest's connection is refused, never sent direct.  Whether the node can
    serve them at all is `why_no_egress_process`."""
    try:
        policy = parse_policy(recorded)
    except InvalidArgument as exc:
        return f"this version cannot read the recorded policy ({exc.message})"
    if policy.public_egress and not config.public_egress:
        return "the policy asks for public egress and this node no longer provides it"
    return None


def needs_egress_process(policy: NetworkPolicy) -> bool:
    """Whether an egress process must serve an Instance with `policy`."""
    return policy.egress is not None or policy.resolver is not None


def why_no_egress_process(policy: NetworkPolicy, *, served: bool) -> str | None:
    """Why the node refuses `policy` at admission (a create or a network switch), or
    None: a policy naming an Egress or a Resolver needs an egress process serving this
    Instance, and `served` says whether the node runs them for its Instances (the
    node's serve wires `kibotos.node.egress.supervisor` in; an Instance manager run
    without it, as in some tests and tools, does not).  Without one its table would
    steer the guest to a port where nothing listens: the Workspace would be accepted and
    could reach nothing, so it is refused instead, before anything is written (it fails
    closed, and says so)."""
    if served or not needs_egress_process(policy):
        return None
    if policy.egress is not None:
        return (f"the policy routes through Egress {policy.egress.name}, and this node has "
                "no egress process")
    assert policy.resolver is not None
    return (f"the policy resolves through Resolver {policy.resolver.name}, and this node "
            "has no egress process")
