"""Putting a policy into force: the first table of an Instance, a network switch, the
rewrite at adoption, and isolation.

Each writes the whole slot table in one transaction (`nft.apply` of
`slot_table.replace_script`).  A network switch is recorded around its transaction:
``pending_policy`` is written first and cleared after, so a crash in between is seen
(check-maintenance: "network switch half done") and adoption finishes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kibotos.core import failpoints
from kibotos.core.errors import FailedPrecondition
from kibotos.network_config import NetworkSection
from kibotos.node.network import netns as ns
from kibotos.node.network import nft
from kibotos.node.network.names import NETNS_DIR
from kibotos.node.network.policy import (
    NetworkPolicy,
    parse_policy,
    to_record,
    why_not_enforceable,
)
from kibotos.node.network.records import NetworkFacts, NetworkRecord, NetworkRecords
from kibotos.node.network.slot_table import TableInputs, isolation_script, replace_script
from kibotos.node.network.table_check import TableReport, check

#: The node's log line of an adoption that rewrote a table (spec wording).
REWRITTEN_LOG = "slot table rewritten from the recorded network policy"


def uplink_addresses(config: NetworkSection, host_netns: Path | None = None) -> list[str]:
    """The uplink's addresses now: the configured one, or the global addresses of the
    configured interface ([] when it is absent or has none)."""
    if not config.uplink:
        return []
    if config.uplink_address is not None:
        return [str(config.uplink_address)]
    with ns.map_netlink_errors(f"read the addresses of uplink {config.uplink}"), \
            ns.netlink(host_netns) as ipr:
        found = ipr.link_lookup(ifname=config.uplink)
        if not found:
            return []
        return sorted(str(a.get_attr("IFA_ADDRESS")) for a in ipr.get_addr(index=found[0])
                      if a["scope"] == 0)  # RT_SCOPE_UNIVERSE


def _write(record: NetworkRecord, policy: dict[str, Any], facts: NetworkFacts,
           netns_dir: Path) -> None:
    inputs = TableInputs.from_record(dataclasses.replace(record, policy=policy, facts=facts))
    nft.apply(record.names.netns_path(netns_dir), replace_script(inputs),
              f"write the slot table of {record.names.instance_id}")


def write_table(records: NetworkRecords, record: NetworkRecord, config: NetworkSection,
                uplink: list[str], *, netns_dir: Path = NETNS_DIR) -> NetworkRecord:
    """Write the table for the record's policy under today's configuration (at setup,
    after `plumbing.setup`), and record the facts it was written from."""
    problem = why_not_enforceable(record.policy, config)
    if problem is not None:
        raise FailedPrecondition(f"network policy of {record.instance_id}: {problem}")
    facts = NetworkFacts.current(config, uplink)
    _write(record, record.policy, facts, netns_dir)
    failpoints.hit("node.network.after-table")
    if facts == record.facts:  # as allocated: the record already says so (no 2nd fsync)
        return record
    updated = dataclasses.replace(record, facts=facts)
    records.write(updated)
    return updated


def switch_policy(records: NetworkRecords, record: NetworkRecord, policy: NetworkPolicy,
                  config: NetworkSection, uplink: list[str], *,
                  netns_dir: Path = NETNS_DIR, revision: int | None = None) -> NetworkRecord:
    """A network switch of a running Instance: in force when this returns, with no
    restart and established connections kept; `revision` is recorded with it."""
    wanted = to_record(policy)
    problem = why_not_enforceable(wanted, config)
    if problem is not None:
        raise FailedPrecondition(f"network switch of {record.instance_id}: {problem}")
    pending = dataclasses.replace(record, pending_policy=wanted, pending_revision=revision)
    records.write(pending)
    failpoints.hit("node.network.switch.after-pending")
    facts = NetworkFacts.current(config, uplink)
    _write(record, wanted, facts, netns_dir)
    failpoints.hit("node.network.switch.after-table")
    done = dataclasses.replace(record, policy=wanted, pending_policy=None, facts=facts,
                               revision=revision, pending_revision=None)
    records.write(done)
    return done


def isolate(record: NetworkRecord, *, netns_dir: Path = NETNS_DIR,
            path: Path | None = None) -> None:
    """Cut the Instance off: the namespace's veth down (no packet leaves, whatever any
    table says) and the node table replaced by one that drops everything.  `path` is
    the namespace when its bind is gone (``/proc/<VMM pid>/ns/net``)."""
    if path is None:
        path = record.names.netns_path(netns_dir)
        if not ns.is_netns(path):
            raise FailedPrecondition(f"isolate the network of {record.instance_id}: its "
                                     f"namespace {path} is missing")
    elif not path.exists():
        raise FailedPrecondition(f"isolate the network of {record.instance_id}: its "
                                 f"namespace {path} is missing")
    with ns.map_netlink_errors(f"isolate the network of {record.instance_id}"), \
            ns.netlink(path) as ipr:
        found = ipr.link_lookup(ifname=record.names.ns_veth)
        if found:
            ipr.link("set", index=found[0], state="down")
    nft.apply(path, isolation_script(), f"isolate the network of {record.instance_id}")


@dataclass(frozen=True)
class Adoption:
    record: NetworkRecord
    report: TableReport
    rewritten: bool

    def log_fields(self) -> dict[str, Any]:
        """The fields of the `REWRITTEN_LOG` line, or of the refusal."""
        fields: dict[str, Any] = {"instance": self.record.instance_id,
                                  "netns": self.record.names.netns,
                                  "differences": "; ".join(self.report.differences) or "none"}
        if self.report.refused:
            fields["refusals"] = "; ".join(self.report.refusals)
        return fields


def adopt(records: NetworkRecords, record: NetworkRecord, config: NetworkSection,
          uplink: list[str], *, netns_dir: Path = NETNS_DIR,
          vmm_netns: Path | None = None) -> Adoption:
    """At node start: rewrite the Instance's table from its recorded policy with this
    version (finishing a switch a crash interrupted), or, in the four refusal cases of
    `table_check`, isolate it (the caller marks the Instance FAILED; its VMM runs on).
    A namespace whose bind is gone is refused, and isolated through `vmm_netns` (the
    VMM's own, ``/proc/<pid>/ns/net``) when the caller has it."""
    report = check(record, config, uplink, netns_dir=netns_dir)
    if report.refused:
        if ns.is_netns(record.names.netns_path(netns_dir)):
            isolate(record, netns_dir=netns_dir)
        elif vmm_netns is not None and vmm_netns.exists():
            isolate(record, path=vmm_netns)
        return Adoption(record, report, rewritten=False)
    switching = record.pending_policy is not None
    policy = record.pending_policy if switching else record.policy
    revision = record.pending_revision if switching else record.revision
    facts = NetworkFacts.current(config, uplink)
    _write(record, policy or {}, facts, netns_dir)
    done = dataclasses.replace(record, policy=policy or {}, pending_policy=None, facts=facts,
                               revision=revision, pending_revision=None)
    records.write(done)
    return Adoption(done, report, rewritten=True)


def guest_interface_config(record: NetworkRecord) -> dict[str, Any]:
    """What the guest agent needs to configure its interface (launch configuration):
    per family the address, prefix and gateway; the gateway is also its resolver."""
    families = [{"family": "ipv4" if link.guest.version == 4 else "ipv6",
                 "address": str(link.guest), "prefix": link.prefix,
                 "gateway": str(link.gateway)} for link in record.slot.families()]
    # with a Resolver the egress process answers on every family's gateway; without
    # one a gateway answers only where the kernel has a deployment resolver to DNAT to
    own_resolver = parse_policy(record.policy).resolver is not None
    return {"addresses": families,
            "resolvers": [str(link.gateway) for link in record.slot.families()
                          if own_resolver or any(_family(r) == link.guest.version
                                                 for r in record.facts.resolvers)]}


def _family(address: str) -> int:
    return 6 if ":" in address else 4

