"""The storage pools a node reports, as ctrl stores them: one pool ID, one storage.

A pool's marker carries an ``instance`` generated once by ``storage-pool init``; every
node attached to the same (shared) storage reports the same one.  Another directory
given the same pool ID has another ``instance``, and ctrl refuses the one that joins
later (spec/storage-pools-on-nfs.txt, "Directory layout"): for that node the pool is
stored as unavailable with a reason naming both instances, and the ctrl log says so.
Placement reads the stored ``available``/``reason`` (`kibotos.ctrl.placement.pools_of`),
so the refused storage is never chosen.

"First" is decided from what ctrl has stored: each node's entry keeps the instance ctrl
accepted for it (``registered_instance``), also across reports in which the node cannot
read its marker (instance None), so a pool that is briefly unreadable on the first node
does not let the second storage win.  Retired and revoked nodes are not members and do
not hold a pool ID.  Stored entries are the node's own fields plus ``registered_instance``
and, when refused, ``conflict`` (the other node and instance).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.ctrl import nodes
from kibotos.ctrl.store.models import Node

log = logging.getLogger("kibotos.ctrl.pools")


def _entries(facts: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    raw = (facts or {}).get("pools") if isinstance(facts, Mapping) else None
    if not isinstance(raw, list):
        return []
    return [dict(item) for item in raw
            if isinstance(item, Mapping) and isinstance(item.get("id"), str)]


def _registered(members: Iterable[Node], node_id: str) -> dict[str, tuple[str, str]]:
    """pool ID -> (node ID, instance) accepted on another member node."""
    out: dict[str, tuple[str, str]] = {}
    for other in members:
        if other.node_id == node_id:
            continue
        for entry in _entries(other.node_facts):
            inst = entry.get("registered_instance")
            if isinstance(inst, str) and entry["id"] not in out:
                out[entry["id"]] = (other.node_id, inst)
    return out


def _members(session: Session, node_id: str) -> list[Node]:
    return list(session.scalars(
        select(Node).where(Node.node_id != node_id, Node.retired_at.is_(None),
                           Node.admission == "admitted").order_by(Node.node_id)))


def accept_pools(session: Session, node: Node, reported: Any, now: datetime
                 ) -> list[dict[str, Any]]:
    """The pools to store for `node` from its reported ``facts.pools``."""
    pools = _entries({"pools": reported})
    previous = {e["id"]: e for e in _entries(node.node_facts)}
    needs_check = any(isinstance(p.get("instance"), str) for p in pools)
    others = _registered(_members(session, node.node_id), node.node_id) if needs_check else {}
    out = []
    for entry in pools:
        pool_id = entry["id"]
        old = previous.get(pool_id, {})
        instance = entry.get("instance")
        entry.pop("conflict", None)
        entry.pop("registered_instance", None)
        if not isinstance(instance, str):
            kept = old.get("registered_instance")
            entry["registered_instance"] = kept if isinstance(kept, str) else None
            out.append(entry)
            continue
        first = others.get(pool_id)
        if first is None or first[1] == instance:
            entry["registered_instance"] = instance
            out.append(entry)
            continue
        other_node, other_instance = first
        reason = (f"storage pool {pool_id} on this node has instance {instance}, but node "
                  f"{other_node} joined first with instance {other_instance}: another "
                  "storage uses the same pool ID (give this directory its own pool ID)")
        entry.update(available=False, reason=reason, registered_instance=None,
                     conflict={"node_id": other_node, "instance": other_instance})
        if old.get("conflict") != entry["conflict"] or old.get("instance") != instance:
            log.warning("storage pool refused: node %s reports pool %s with instance %s, "
                        "node %s joined first with instance %s", node.node_id, pool_id,
                        instance, other_node, other_instance)
            nodes.record_event(session, now, node.node_id, "storage_pool.refused",
                               {"pool_id": pool_id, "instance": instance,
                                "first_node_id": other_node,
                                "first_instance": other_instance}, reason)
        out.append(entry)
    return out


def store_facts(session: Session, node: Node, facts: Mapping[str, Any] | None,
                now: datetime, *, replace: bool) -> None:
    """Store hello facts (`replace`) or a report's facts (merged: a report may carry
    only the pools).  A new dict each time: the JSON column is not mutation-tracked."""
    base: dict[str, Any] = {} if replace else dict(node.node_facts or {})
    incoming = dict(facts or {})
    if "pools" in incoming:
        incoming["pools"] = accept_pools(session, node, incoming["pools"], now)
    node.node_facts = {**base, **incoming}
