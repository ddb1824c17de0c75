"""The node's table in the host namespace: public egress, and the host kept out of reach.

One per node (``inet kibotos-<scope>``, so nodes sharing a host keep their own), written
whole in one transaction at node start; nothing in it is per Instance (it matches the
pools and the ``kbv*`` veths), so Instance setup and teardown never touch it.

* postrouting: traffic of the pools leaving by any interface but an Instance veth is
  masqueraded to that interface's address, or SNAT'd to ``uplink`` when the uplink is
  given as an address and the traffic leaves by the interface that has it;
* input: from an Instance veth only replies, neighbour discovery and DNS to a deployment
  resolver reach the host (a host address in ``resolvers``); every other address of the
  host, ctrl on the same host included, is unreachable from guests whatever the policy;
* forward: nothing goes from one Instance veth to another through the host.

It also turns on forwarding in the host namespace (``net.ipv4.ip_forward``, and IPv6
forwarding with an ``ipv6_pool``), without which nothing leaves an Instance.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from kibotos.core import cidrs
from kibotos.core.errors import FailedPrecondition
from kibotos.network_config import NetworkSection
from kibotos.node.network import netns as ns
from kibotos.node.network import nft
from kibotos.node.network.names import HOST_VETH_PREFIX, TABLE_FAMILY

FORMAT = 1


def table_name(scope: str) -> str:
    return f"kibotos-{scope}"


def _interface_of(address: str, host_netns: Path | None) -> str:
    with ns.map_netlink_errors(f"find the interface of uplink {address}"), \
            ns.netlink(host_netns) as ipr:
        for entry in ipr.get_addr():
            if entry.get_attr("IFA_ADDRESS") == address:
                links = ipr.get_links(entry["index"])
                return str(links[0].get_attr("IFLA_IFNAME"))
    raise FailedPrecondition(f"uplink {address} is not an address of this host")


def render(config: NetworkSection, scope: str, *, host_netns: Path | None = None) -> str:
    veths = f'"{HOST_VETH_PREFIX}*"'
    pools: list[cidrs.Network] = [config.pool4]
    if config.pool6 is not None:
        pools.append(config.pool6)
    resolvers: list[cidrs.Network] = [ipaddress.ip_network(r) for r in config.resolvers]
    lines = [f"table {TABLE_FAMILY} {table_name(scope)} {{",
             f'\tcomment "kibotos host table, format {FORMAT}"']
    for family in (4, 6):
        kind = f"ipv{family}_addr"
        for name, networks in (("slots", pools), ("resolver", resolvers)):
            elements = ", ".join(str(n) for n in cidrs.of_family(networks, family))
            body = f" elements = {{ {elements} }};" if elements else ""
            lines.append(f"\tset {name}{family} {{ type {kind}; flags interval;{body} }}")
    lines += ["\tchain input {", "\t\ttype filter hook input priority filter; policy accept;",
              f"\t\tiifname {veths} ct state established,related accept",
              f"\t\tiifname {veths} icmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert }} "
              "accept",
              f"\t\tiifname {veths} ip daddr @resolver4 meta l4proto {{ tcp, udp }} "
              "th dport 53 accept",
              f"\t\tiifname {veths} ip6 daddr @resolver6 meta l4proto {{ tcp, udp }} "
              "th dport 53 accept",
              f"\t\tiifname {veths} drop", "\t}",
              "\tchain forward {", "\t\ttype filter hook forward priority filter; policy accept;",
              f"\t\tiifname {veths} oifname {veths} drop", "\t}",
              "\tchain postrouting {",
              "\t\ttype nat hook postrouting priority srcnat; policy accept;"]
    address = config.uplink_address
    if address is not None:
        ip = "ip" if address.version == 4 else "ip6"
        device = _interface_of(str(address), host_netns)
        lines.append(f'\t\t{ip} saddr @slots{address.version} oifname "{device}" '
                     f"snat {ip} to {address}")
    lines += [f"\t\tip saddr @slots4 oifname != {veths} masquerade",
              f"\t\tip6 saddr @slots6 oifname != {veths} masquerade", "\t}", "}"]
    return "\n".join(lines) + "\n"


def prepare_host(config: NetworkSection, scope: str, *, host_netns: Path | None = None) -> None:
    """Forwarding on and the host table (re)written: at node start, and again when the
    configuration changed.  Established connections are kept."""
    values = {"net.ipv4.ip_forward": "1"}
    if config.pool6 is not None:
        values["net.ipv6.conf.all.forwarding"] = "1"
    with ns.map_netlink_errors("turn on forwarding in the host namespace"):
        ns.write_sysctls(host_netns, values)
    name = f"{TABLE_FAMILY} {table_name(scope)}"
    nft.apply(host_netns, f"table {name}\ndelete table {name}\n"
              + render(config, scope, host_netns=host_netns), "write the host table")


def remove_host_table(scope: str, *, host_netns: Path | None = None) -> None:
    """Remove the host table (the node's [network] was removed); forwarding stays as it
    is, other software on the host may rely on it."""
    name = f"{TABLE_FAMILY} {table_name(scope)}"
    nft.apply(host_netns, f"table {name}\ndelete table {name}\n", "remove the host table")
