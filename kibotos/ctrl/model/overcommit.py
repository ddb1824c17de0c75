"""Overcommit ratios: the cluster default, per-node overrides, and what placement uses.

Ratios are kept in thousandths (`kibotos.core.units.parse_ratio`), so ``2.5`` is 2500 and
comparisons are exact.  The schedulable amount is what the node reported times the
effective ratio.  Whenever a node's effective ratio changes, its
``overcommit_sent_serial`` goes up; the node is not placeable until it acknowledges that
serial over its control session (`session.py` sends it and records the ack).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from kibotos.core.errors import Aborted
from kibotos.core.units import format_ratio, parse_ratio
from kibotos.ctrl.model import nodes
from kibotos.ctrl.store.models import ClusterSetting, Node

DEFAULT_KEY = "overcommit_default"
ONE = 1000  # a ratio of 1, in thousandths


@dataclass(frozen=True)
class DefaultRatios:
    """The cluster-wide default.  A store without the setting row has 1 and 1 at
    version 1; the first change writes the row at version 2."""

    cpu: int = ONE
    memory: int = ONE
    version: int = 1


def get_default(session: Session, *, for_update: bool = False) -> DefaultRatios:
    row = session.get(ClusterSetting, DEFAULT_KEY, with_for_update=for_update)
    if row is None:
        return DefaultRatios()
    return default_of(row.value, row.version)


def default_of(value: dict[str, Any] | None, version: int | None) -> DefaultRatios:
    """The default from its setting row's value and version (None: no row yet)."""
    if value is None or version is None:
        return DefaultRatios()
    return DefaultRatios(cpu=int(value["cpu"]), memory=int(value["memory"]),
                         version=int(version))


def effective(node: nodes.NodeFacts, default: DefaultRatios) -> tuple[int, str, int, str]:
    """(cpu ratio, its source, memory ratio, its source)."""
    cpu, cpu_src = ((node.overcommit_cpu, "override") if node.overcommit_cpu is not None
                    else (default.cpu, "default"))
    mem, mem_src = ((node.overcommit_memory, "override") if node.overcommit_memory is not None
                    else (default.memory, "default"))
    return cpu, cpu_src, mem, mem_src


def schedulable(node: nodes.NodeFacts, default: DefaultRatios) -> tuple[int, int]:
    """What placement may hand out on this node: reported × ratio, rounded down."""
    cpu, _, mem, _ = effective(node, default)
    return node.resources_cpu_millis * cpu // ONE, node.resources_memory_bytes * mem // ONE


def push_message(node: nodes.NodeFacts, default: DefaultRatios) -> dict[str, Any]:
    """The fields of the ``overcommit`` message (and of ``welcome.overcommit``)."""
    cpu, _, mem, _ = effective(node, default)
    return {"cpu": format_ratio(cpu), "memory": format_ratio(mem),
            "serial": node.overcommit_sent_serial}


def overview(session: Session) -> dict[str, Any]:
    default = get_default(session)
    rows = session.scalars(
        select(Node)
        .where(or_(Node.overcommit_cpu.is_not(None), Node.overcommit_memory.is_not(None)))
        .order_by(Node.node_id)
    )
    return {
        "default": {"cpu": format_ratio(default.cpu), "memory": format_ratio(default.memory)},
        "version": default.version,
        "overrides": [
            {
                "node_id": n.node_id,
                "cpu": None if n.overcommit_cpu is None else format_ratio(n.overcommit_cpu),
                "memory": (None if n.overcommit_memory is None
                           else format_ratio(n.overcommit_memory)),
                "registration_version": n.registration_version,
            }
            for n in rows
        ],
    }


def set_default(session: Session, cpu: str | None, memory: str | None,
                expected: int | None, now: datetime) -> list[str]:
    """Change the items given and keep the other; returns the nodes whose effective
    ratio changed (their serial went up, so they must be told)."""
    old = get_default(session, for_update=True)
    if expected is not None and expected != old.version:
        raise Aborted(
            f"the overcommit default is at version {old.version}, not {expected}: "
            "read it again and retry",
            details={"version": old.version, "expected_version": expected},
        )
    new_cpu = old.cpu if cpu is None else parse_ratio(cpu, "cpu ratio")
    new_mem = old.memory if memory is None else parse_ratio(memory, "memory ratio")
    row = session.get(ClusterSetting, DEFAULT_KEY, with_for_update=True)
    value = {"cpu": new_cpu, "memory": new_mem}
    if row is None:
        session.add(ClusterSetting(key=DEFAULT_KEY, value=value, version=old.version + 1,
                                   updated_at=now))
    else:
        row.value = value
        row.version = old.version + 1
        row.updated_at = now
    changed: list[str] = []
    if (new_cpu, new_mem) != (old.cpu, old.memory):
        affected = session.scalars(
            select(Node).where(Node.retired_at.is_(None)).with_for_update()
        )
        for node in affected:
            if ((node.overcommit_cpu is None and new_cpu != old.cpu)
                    or (node.overcommit_memory is None and new_mem != old.memory)):
                node.overcommit_sent_serial += 1
                changed.append(node.node_id)
    nodes.record_event(session, now, DEFAULT_KEY, "overcommit.set_default",
                       {"cpu": format_ratio(new_cpu), "memory": format_ratio(new_mem)})
    return changed


def set_node(session: Session, node_id: str, cpu: str | None, memory: str | None,
             expected: int | None, now: datetime) -> tuple[Node, bool]:
    """Set or clear (``"default"``) one node's override; returns the node and whether
    its effective ratio changed."""
    node = nodes.get_node(session, node_id, for_update=True)
    nodes.refuse_retired(node, "overcommit set")
    nodes.check_version(node, expected)
    default = get_default(session)
    before = effective(node, default)
    if cpu is not None:
        node.overcommit_cpu = None if cpu == "default" else parse_ratio(cpu, "cpu ratio")
    if memory is not None:
        node.overcommit_memory = (None if memory == "default"
                                  else parse_ratio(memory, "memory ratio"))
    after = effective(node, default)
    changed = (before[0], before[2]) != (after[0], after[2])
    if changed:
        node.overcommit_sent_serial += 1
    nodes.bump(node)
    nodes.record_event(session, now, node_id, "overcommit.set",
                       {"cpu": format_ratio(after[0]), "cpu_source": after[1],
                        "memory": format_ratio(after[2]), "memory_source": after[3]})
    return node, changed
