"""Reading a slot table back: what differs from what this version would write, and
whether the node may rewrite it at all.

At adoption the node regenerates an Instance's table from the recorded policy and
replaces it (spec: node-and-vmm-processes, "Launch records and adoption"), except in
four cases where it isolates the Instance's network instead and marks it FAILED:

1. the namespace has no node table, or has tables that are not the node's;
2. an address set (all but the resolver sets) does not match the record, or the record
   no longer matches the configuration (``management_cidrs`` or the uplink's address
   changed, the pools moved);
3. rules or chains were added by hand (a rule without the node's comment, a chain with
   no rule of the node's);
4. this version cannot enforce the recorded policy (`policy.why_not_enforceable`).

Everything else that differs (rules of another version, resolvers that changed, the
reserved ranges of another version) is a *difference*: the rewrite fixes it, and the
log of the rewrite lists it.  Rules and sets are compared after both went through the
same nft and kernel (`nft.canonical`), so formatting never counts as a difference.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kibotos.core import cidrs
from kibotos.network_config import NetworkSection
from kibotos.node.network import nft
from kibotos.node.network.names import NETNS_DIR, TABLE, TABLE_FAMILY
from kibotos.node.network.netns import is_netns
from kibotos.node.network.policy import parse_policy, why_not_enforceable
from kibotos.node.network.records import NetworkRecord
from kibotos.node.network.slot_table import (
    COMMENT_PREFIX,
    RECORDED_SETS,
    TableInputs,
    address_sets,
    render,
)


@dataclass(frozen=True)
class TableReport:
    """`refusals`: why the table must not be rewritten (empty: it may be);
    `differences`: what a rewrite changes."""

    refusals: tuple[str, ...]
    differences: tuple[str, ...]

    @property
    def refused(self) -> bool:
        return bool(self.refusals)


def _elements(values: Iterable[Any]) -> list[cidrs.Network]:
    found: list[cidrs.Network] = []
    for value in values:
        if isinstance(value, dict) and "elem" in value:  # an element with options
            value = value["elem"].get("val")
        if isinstance(value, str):
            found.append(ipaddress.ip_network(value))
        elif isinstance(value, dict) and "prefix" in value:
            found.append(ipaddress.ip_network(f"{value['prefix']['addr']}/"
                                              f"{value['prefix']['len']}"))
        elif isinstance(value, dict) and "range" in value:
            low, high = (ipaddress.ip_address(a) for a in value["range"])
            found += ipaddress.summarize_address_range(low, high)
        else:
            raise ValueError(f"unexpected set element {value!r}")
    return found


def set_contents(set_object: dict[str, Any]) -> list[cidrs.Network]:
    family: cidrs.Family = 6 if set_object.get("type") == "ipv6_addr" else 4
    return cidrs.of_family(_elements(set_object.get("elem", [])), family)


def _text(networks: list[cidrs.Network]) -> str:
    return "{" + ", ".join(str(n) for n in networks) + "}"


def _ours(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o[kind] for o in objects if kind in o and o[kind].get("family") == TABLE_FAMILY
            and o[kind].get("table") == TABLE]


def _is_node_rule(rule: dict[str, Any]) -> bool:
    return str(rule.get("comment", "")).startswith(COMMENT_PREFIX)


def _summary(rule: dict[str, Any]) -> str:
    return json.dumps(rule.get("expr"), separators=(",", ":"), sort_keys=True)[:200]


def compare(actual: list[dict[str, Any]], expected: list[dict[str, Any]],
            recorded_sets: list[dict[str, list[cidrs.Network]]],
            config_sets: dict[str, list[cidrs.Network]],
            policy_problem: str | None) -> TableReport:
    """The report for the listing `actual` of a namespace, against `expected` (the
    canonical listing of what this version writes now), the set contents the record
    allows (several while a policy switch is half done) and the configuration's."""
    refusals = _table_refusals(actual)
    differences: list[str] = []
    if any(t["table"]["family"] == TABLE_FAMILY and t["table"]["name"] == TABLE
           for t in actual if "table" in t):
        _compare_sets(actual, recorded_sets, config_sets, refusals, differences)
        _compare_chains(actual, expected, refusals, differences)
    if policy_problem is not None:
        refusals.append(policy_problem)
    return TableReport(tuple(refusals), tuple(differences))


def _table_refusals(actual: list[dict[str, Any]]) -> list[str]:
    refusals = []
    tables = [(t["table"]["family"], t["table"]["name"]) for t in actual if "table" in t]
    for family, name in tables:
        if (family, name) != (TABLE_FAMILY, TABLE):
            refusals.append(f"the namespace has the table {family} {name}, which is not "
                            "the node's")
    if (TABLE_FAMILY, TABLE) not in tables:
        refusals.append(f"the namespace has no node table ({TABLE_FAMILY} {TABLE})")
    return refusals


def _compare_sets(actual: list[dict[str, Any]],
                  recorded_sets: list[dict[str, list[cidrs.Network]]],
                  config_sets: dict[str, list[cidrs.Network]],
                  refusals: list[str], differences: list[str]) -> None:
    found = {s["name"]: set_contents(s) for s in _ours(actual, "set")}
    for name in sorted(set(found) - set(config_sets)):
        differences.append(f"set {name} is not one this version writes")
    for name, wanted in config_sets.items():
        have = found.get(name)
        if name not in RECORDED_SETS:  # resolvers may change; reserved is per version
            if have != wanted:
                differences.append(f"set {name}: {_text(have or [])} becomes {_text(wanted)}")
            continue
        allowed = [r[name] for r in recorded_sets]
        if have is None and not any(allowed):
            differences.append(f"set {name} is missing (empty in the record)")
        elif (have or []) not in allowed:
            refusals.append(f"address set {name} holds {_text(have or [])}, the record "
                            f"says {_text(allowed[0])}")
        elif wanted not in allowed:
            refusals.append(f"address set {name}: the record says {_text(allowed[0])}, the "
                            f"configuration now {_text(wanted)}")


def _compare_chains(actual: list[dict[str, Any]], expected: list[dict[str, Any]],
                    refusals: list[str], differences: list[str]) -> None:
    def by_chain(objects: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        rules: dict[str, list[dict[str, Any]]] = {c["name"]: [] for c in _ours(objects, "chain")}
        for rule in _ours(objects, "rule"):
            rules.setdefault(rule["chain"], []).append(rule)
        return rules

    def header(chain: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(chain.get(k) for k in ("type", "hook", "prio", "policy"))

    have, want = by_chain(actual), by_chain(expected)
    have_headers = {c["name"]: header(c) for c in _ours(actual, "chain")}
    want_headers = {c["name"]: header(c) for c in _ours(expected, "chain")}
    for chain, rules in have.items():
        hand = [r for r in rules if not _is_node_rule(r)]
        for rule in hand:
            refusals.append(f"chain {chain} has a rule added by hand: {_summary(rule)}")
        if chain not in want:
            if not rules:
                refusals.append(f"chain {chain} was added by hand")
            elif not hand:
                differences.append(f"chain {chain} is not one this version writes")
            continue
        if have_headers.get(chain) != want_headers[chain]:
            differences.append(f"chain {chain}: {have_headers.get(chain)} becomes "
                               f"{want_headers[chain]}")
        mine = {r["comment"]: r["expr"] for r in rules if _is_node_rule(r)}
        wanted = {r["comment"]: r["expr"] for r in want[chain]}
        for comment in sorted(set(mine) | set(wanted)):
            if comment not in wanted:
                differences.append(f"rule {comment} in chain {chain} is not one this "
                                   "version writes")
            elif comment not in mine:
                differences.append(f"rule {comment} in chain {chain} is missing")
            elif mine[comment] != wanted[comment]:
                differences.append(f"rule {comment} in chain {chain} differs")
        order = [c for c in (r["comment"] for r in rules if _is_node_rule(r)) if c in wanted]
        if order != [c for c in wanted if c in mine]:
            differences.append(f"the rules of chain {chain} are in another order")
    for chain in sorted(set(want) - set(have)):
        differences.append(f"chain {chain} is missing")


def check(record: NetworkRecord, config: NetworkSection, uplink_addresses: list[str], *,
          netns_dir: Path = NETNS_DIR) -> TableReport:
    """Read the table of the record's namespace and report (`compare`)."""
    policy_problem = why_not_enforceable(record.policy, config)
    path = record.names.netns_path(netns_dir)
    if not is_netns(path):  # nothing to read, and nothing to rewrite
        return TableReport((f"the network namespace {path} is missing",), ())
    actual = nft.ruleset(path, f"read the slot table of {record.names.netns}")
    if policy_problem is not None:  # nothing this version could write to compare with
        return TableReport((*_table_refusals(actual), policy_problem), ())
    current = TableInputs.from_config(record, config, uplink_addresses)
    expected = nft.canonical(render(current), "canonical slot table")
    recorded = [address_sets(TableInputs.from_record(record))]
    if record.pending_policy is not None:  # a switch half done: either table is fine
        switched = TableInputs(slot=record.slot, policy=parse_policy(record.pending_policy),
                               facts=record.facts)
        recorded.append(address_sets(switched))
    return compare(actual, expected, recorded, address_sets(current), None)
