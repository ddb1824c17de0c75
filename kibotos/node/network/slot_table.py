"""The slot table: the node's one nftables table in an Instance's namespace.

Generated whole from a network policy and the node's facts (`TableInputs`) and written
whole: `replace_script` deletes and recreates the table in one transaction, so a guest
never sees half a policy, and established connections survive (conntrack keeps them and
the first rule of every chain accepts them).  Every rule carries a comment
``kibotos/<format>:<id>`` so a reader can tell the node's rules from ones added by hand.

Named sets, one per family (suffix 4 or 6): ``guest`` (the guest's address), ``instances``
(the pools: every Instance of the node, the host ends of their veths too), ``management``
(``management_cidrs``), ``uplink`` (the uplink's addresses), ``resolver`` (the deployment
resolvers), ``allow`` and ``deny`` (the policy), ``reserved`` (`cidrs.NEVER_REACHABLE_4`
and ``_6``).

What the chains do, in order (forward, the guest's traffic):

1. replies of established connections pass; nothing else enters towards the guest;
2. a packet whose source is not the guest's address is dropped (no spoofing);
3. DNS the prerouting chain redirected (DNAT) to a deployment resolver passes: the guest
   asks its gateway, the kernel answers through the resolver, no process in between;
4. reserved ranges, other Instances, management CIDRs and the uplink's own addresses are
   rejected, whatever the policy;
5. with public egress: ``allow`` passes, then ``deny`` is rejected, then the rest passes;
   without it, the rest is rejected.

The namespace itself (input, output) accepts only loopback, replies, neighbour discovery
and pings of the gateway.  The postrouting chain masquerades the guest to the
namespace's veth address.

Steering to the egress process (`kibotos.egress`), whose sockets the node opens in the
namespace on the gateway address:

* with an Egress, the prerouting chain redirects the guest's TCP to ``EGRESS_PORT``,
  except to the never-reachable destinations (reserved, other Instances, management,
  the uplink's own) and, unless allowed, to ``deny``: those go on to the forward chain,
  which rejects them as before.  The input chain accepts only redirected connections
  from the guest's own address there.  No TCP of the guest leaves directly, whatever
  ``public_egress`` says; when the egress process is down, nothing listens and the
  guest's connection is refused (fail closed);
* with a Resolver, DNS to the gateway is not DNAT'd to the deployment resolver: the
  input chain accepts it for the egress process's sockets on the gateway's port 53.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from kibotos.core import cidrs
from kibotos.network_config import NetworkSection
from kibotos.node.network.names import DNS_PORT, EGRESS_PORT, NS_VETH, TABLE, TABLE_FAMILY, TAP
from kibotos.node.network.policy import NetworkPolicy, parse_policy
from kibotos.node.network.records import NetworkFacts, NetworkRecord
from kibotos.node.network.slots import SlotAddresses

FORMAT = 1
COMMENT_PREFIX = "kibotos/"
CHAINS = ("prerouting", "postrouting", "input", "output", "forward")
#: Sets whose content comes from the record and the node's configuration, and must match
#: both at adoption (`table_check`); the resolver sets may change, the reserved ones
#: are this version's.
RECORDED_SETS = tuple(f"{n}{f}" for n in ("guest", "instances", "management", "uplink",
                                            "allow", "deny") for f in (4, 6))
SET_NAMES = (*RECORDED_SETS, "resolver4", "resolver6", "reserved4", "reserved6")
REJECT = "reject with icmpx type admin-prohibited"


@dataclass(frozen=True)
class TableInputs:
    slot: SlotAddresses
    policy: NetworkPolicy
    facts: NetworkFacts
    tap: str = TAP
    ns_veth: str = NS_VETH

    @classmethod
    def from_record(cls, record: NetworkRecord) -> TableInputs:
        """The table as the record describes it (the facts it was last written from)."""
        return cls(slot=record.slot, policy=parse_policy(record.policy), facts=record.facts)

    @classmethod
    def from_config(cls, record: NetworkRecord, config: NetworkSection,
                    uplink_addresses: list[str]) -> TableInputs:
        """The table this node would write now: the record's slot and policy, today's
        configuration and uplink addresses."""
        return cls(slot=record.slot, policy=parse_policy(record.policy),
                   facts=NetworkFacts.current(config, uplink_addresses))


def _networks(values: Iterable[str]) -> list[cidrs.Network]:
    return [ipaddress.ip_network(v) for v in values]


def address_sets(inputs: TableInputs) -> dict[str, list[cidrs.Network]]:
    """Each named set's content in canonical form (collapsed, sorted)."""
    facts, slot = inputs.facts, inputs.slot
    guest = [ipaddress.ip_network(link.guest) for link in slot.families()]
    sources: dict[str, list[cidrs.Network]] = {
        "guest": guest,
        "instances": _networks(facts.pools),
        "management": _networks(facts.management_cidrs),
        "uplink": _networks(facts.uplink_addresses),
        "resolver": _networks(facts.resolvers),
        "allow": _networks(inputs.policy.allow_out),
        "deny": _networks(inputs.policy.deny_out),
        "reserved": [*cidrs.NEVER_REACHABLE_4, *cidrs.NEVER_REACHABLE_6],
    }
    return {f"{name}{family}": cidrs.of_family(networks, family)
            for name, networks in sources.items() for family in (4, 6)}


def _set(name: str, elements: list[cidrs.Network]) -> str:
    kind = "ipv4_addr" if name.endswith("4") else "ipv6_addr"
    body = f"type {kind}; flags interval;"
    if elements:
        body += " elements = { " + ", ".join(str(e) for e in elements) + " };"
    return f"\tset {name} {{ {body} }}"


def _rule(rule_id: str, text: str) -> str:
    return f'\t\t{text} comment "{COMMENT_PREFIX}{FORMAT}:{rule_id}"'


def _chain(name: str, header: str, rules: list[tuple[str, str]]) -> str:
    lines = [f"\tchain {name} {{", f"\t\t{header}", *(_rule(i, t) for i, t in rules), "\t}"]
    return "\n".join(lines)


def _first(addresses: Iterable[str], family: int) -> str | None:
    return next((a for a in addresses if ipaddress.ip_address(a).version == family), None)


def chains(inputs: TableInputs) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """Each chain's header and its ``(rule id, rule)`` list."""
    tap, veth = f'"{inputs.tap}"', f'"{inputs.ns_veth}"'
    pre: list[tuple[str, str]] = []
    post: list[tuple[str, str]] = []
    inp = [("lo", 'iifname "lo" accept'), ("replies", "ct state established,related accept"),
           ("neighbours", "icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } accept")]
    out = [("lo", 'oifname "lo" accept'), ("replies", "ct state established,related accept"),
           ("neighbours", "icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } accept"),
           ("errors4", "icmp type { destination-unreachable, time-exceeded, "
                       "parameter-problem } accept"),
           ("errors6", "icmpv6 type { destination-unreachable, packet-too-big, "
                       "time-exceeded, parameter-problem } accept")]
    fwd = [("replies", "ct state established,related accept"),
           ("invalid", "ct state invalid drop"),
           ("inbound", f"iifname != {tap} drop"),
           ("outbound", f"oifname != {veth} drop"),
           ("spoof4", "meta nfproto ipv4 ip saddr != @guest4 drop"),
           ("spoof6", "meta nfproto ipv6 ip6 saddr != @guest6 drop")]
    policy = inputs.policy
    for link in inputs.slot.families():
        v, ip = (4, "ip") if link.guest.version == 4 else (6, "ip6")
        icmp = "icmp" if v == 4 else "icmpv6"
        resolver = _first(inputs.facts.resolvers, v)
        if policy.resolver is not None:
            inp.append((f"resolver{v}", f"iifname {tap} {ip} saddr @guest{v} {ip} daddr "
                                        f"{link.gateway} meta l4proto {{ tcp, udp }} th dport "
                                        f"{DNS_PORT} accept"))
        elif resolver is not None:
            pre.append((f"dns{v}", f"iifname {tap} {ip} daddr {link.gateway} meta l4proto "
                                   f"{{ tcp, udp }} th dport 53 dnat {ip} to {resolver}"))
            fwd.append((f"dns{v}", f"ct status dnat {ip} daddr @resolver{v} meta l4proto "
                                   "{ tcp, udp } th dport 53 accept"))
        if policy.egress is not None:
            pre += _egress_steering(tap, v, ip)
            inp.append((f"egress{v}", f"iifname {tap} {ip} saddr @guest{v} ct status dnat "
                                      f"meta l4proto tcp th dport {EGRESS_PORT} accept"))
        post.append((f"masquerade{v}", f"oifname {veth} {ip} saddr @guest{v} masquerade"))
        inp.append((f"ping{v}", f"iifname {tap} {ip} daddr {link.gateway} {icmp} type "
                                "echo-request accept"))
    for name in ("reserved", "instances", "management", "uplink"):
        fwd += [(f"{name}4", f"ip daddr @{name}4 {REJECT}"),
                (f"{name}6", f"ip6 daddr @{name}6 {REJECT}")]
    if inputs.policy.public_egress:
        fwd += [("allow4", "ip daddr @allow4 accept"), ("allow6", "ip6 daddr @allow6 accept"),
                ("deny4", f"ip daddr @deny4 {REJECT}"), ("deny6", f"ip6 daddr @deny6 {REJECT}"),
                ("public", "accept")]
    else:
        fwd.append(("no-public-egress", REJECT))
    inp.append(("guest", f"iifname {tap} {REJECT}"))
    nat = "type nat hook {} priority {}; policy accept;"
    flt = "type filter hook {} priority filter; policy drop;"
    return {"prerouting": (nat.format("prerouting", "dstnat"), pre),
            "postrouting": (nat.format("postrouting", "srcnat"), post),
            "input": (flt.format("input"), inp), "output": (flt.format("output"), out),
            "forward": (flt.format("forward"), fwd)}


def _egress_steering(tap: str, v: int, ip: str) -> list[tuple[str, str]]:
    """Prerouting rules that redirect the guest's TCP of one family to the egress
    process; destinations it must never reach, and denied ones, are left for the
    forward chain to reject."""
    skip = [(f"egress-skip-{name}{v}", f"iifname {tap} {ip} daddr @{name}{v} return")
            for name in ("reserved", "instances", "management", "uplink")]
    redirect = f"meta l4proto tcp redirect to :{EGRESS_PORT}"
    return [*skip,
            (f"egress-allow{v}", f"iifname {tap} {ip} daddr @allow{v} {redirect}"),
            (f"egress-skip-deny{v}", f"iifname {tap} {ip} daddr @deny{v} return"),
            (f"egress{v}", f"iifname {tap} meta nfproto ipv{v} {redirect}")]


def render(inputs: TableInputs) -> str:
    """The table's definition (``table inet kibotos { … }``)."""
    sets = address_sets(inputs)
    parts = [f"table {TABLE_FAMILY} {TABLE} {{",
             f'\tcomment "kibotos slot table, format {FORMAT}"',
             *(_set(name, sets[name]) for name in SET_NAMES),
             *(_chain(name, header, rules) for name, (header, rules) in chains(inputs).items()),
             "}"]
    return "\n".join(parts) + "\n"


def _replacing(definition: str) -> str:
    # "table x" first so "delete table x" cannot fail on a namespace without it; all
    # three lines are one transaction
    return (f"table {TABLE_FAMILY} {TABLE}\ndelete table {TABLE_FAMILY} {TABLE}\n"
            + definition)


def replace_script(inputs: TableInputs) -> str:
    return _replacing(render(inputs))


def isolation_script() -> str:
    """The table of an isolated Instance: nothing in or out of the namespace but its own
    loopback, the guest cut off (whatever other tables in the namespace accept: a drop
    in any base chain is final)."""
    drop = "type filter hook {} priority filter; policy drop;"
    body = [f"table {TABLE_FAMILY} {TABLE} {{",
            '\tcomment "kibotos slot table, isolated"',
            _chain("input", drop.format("input"), [("isolated-lo", 'iifname "lo" accept')]),
            _chain("forward", drop.format("forward"), []),
            _chain("output", drop.format("output"), [("isolated-lo", 'oifname "lo" accept')]),
            "}"]
    return _replacing("\n".join(body) + "\n")
