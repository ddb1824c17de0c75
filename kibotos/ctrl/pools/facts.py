"""The storage pools a node reports, as ctrl stores them: one pool ID, one storage.

A pool's marker carries an ``instance`` generated once by ``storage-pool init``; every
node attached to the same (shared) storage reports the same one.  Another directory
given the same pool ID has another ``instance``, and ctrl refuses the one that joins
later (spec/storage-pools-on-nfs.txt, "Directory layout"): for that node the pool is
stored as unavailable with a reason naming both instances, and the ctrl log says so.
Placement reads the stored ``available``/``reason`` (`kibotos.ctrl.model.placement.pools_of`),
so the refused storage is never chosen.

"First" is decided from what ctrl has stored: each node's entry keeps the instance ctrl
accepted for it (``registered_instance``), also across reports in which the node cannot
read its marker (instance None), so a pool that is briefly unreadable on the first node
does not let the second storage win.  Retired and revoked nodes are not members and do
not hold a pool ID.  Stored entries are the node's own fields plus ``registered_instance``
and, when refused, ``conflict`` (the other node and instance) with the node's own
verdict kept in ``node_available``/``node_reason``, so `reconsider` can accept the
storage again once the first node is retired or revoked without waiting for a report.

The pool ID itself has a row in ``storage_pools`` (`register`): made the first time a
node reports it, it holds the registered instance and node, which move to the node that
reports the same storage after the first one stopped being a member (spec:
storage-pools-on-nfs, "Moving a pool to another host").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from kibotos.ctrl.model import nodes
from kibotos.ctrl.store.models import Node, StoragePool

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
        if "node_available" in entry:  # a stored refused entry, looked at again
            entry["available"] = entry.pop("node_available")
            entry["reason"] = entry.pop("node_reason", None)
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
                     conflict={"node_id": other_node, "instance": other_instance},
                     node_available=entry.get("available", True),
                     node_reason=entry.get("reason"))
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
        register(session, node, incoming["pools"], now)
    node.node_facts = {**base, **incoming}


def is_member(node: Node) -> bool:
    """Retired and revoked nodes are no pool's members (spec/nodes.txt, "retire")."""
    return node.retired_at is None and node.admission == "admitted"


def ensure_row(session: Session, pool_id: str, now: datetime) -> StoragePool:
    """The pool's row, made if missing; an insert that another transaction beat is
    ignored (two nodes of one shared pool may report it at once)."""
    values = {"pool_id": pool_id, "capacity_bytes": None, "instance": None,
              "registered_node_id": None, "lost_at": None, "lost_instance": None,
              "revision": 1, "created_at": now, "updated_at": now}
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    session.execute(dialect.insert(StoragePool).values(**values)
                    .on_conflict_do_nothing(index_elements=["pool_id"]))
    row = session.get(StoragePool, pool_id, with_for_update=True, populate_existing=True)
    assert row is not None
    return row


def _holds(session: Session, row: StoragePool, instance: str) -> bool:
    """The registration already names `instance` on a node that is still a member."""
    if row.instance != instance or row.registered_node_id is None:
        return False
    holder = session.get(Node, row.registered_node_id)
    return holder is not None and is_member(holder)


def register(session: Session, node: Node, pools: list[dict[str, Any]], now: datetime
             ) -> None:
    """Keep ``storage_pools`` in step with what was accepted for `node`: the pool row
    exists, and its registration names a member node that reports the registered
    instance; when the registered node is no longer a member (or never was), the
    registration moves to `node`, and a lost pool declared again is no longer lost."""
    if not is_member(node):
        return
    for entry in pools:
        instance = entry.get("registered_instance")
        # Most reports change nothing here: read first, lock only to change.
        row = session.get(StoragePool, entry["id"]) or ensure_row(session, entry["id"], now)
        if not isinstance(instance, str) or _holds(session, row, instance):
            continue
        locked = session.get(StoragePool, entry["id"], with_for_update=True,
                             populate_existing=True)
        assert locked is not None
        row = locked
        if _holds(session, row, instance):
            continue
        previous = row.registered_node_id
        row.instance = instance
        row.registered_node_id = node.node_id
        row.lost_at = None
        row.revision += 1
        row.updated_at = now
        log.info("storage pool registered: pool %s instance %s on node %s (was %s)",
                 row.pool_id, instance, node.node_id, previous)
        nodes.record_event(session, now, row.pool_id, "storage_pool.registered",
                           {"instance": instance, "node_id": node.node_id,
                            "previous_node_id": previous})


def reconsider(session: Session, now: datetime) -> None:
    """Accept again, at once, the storages refused because another node had the pool
    ID first, once that node stopped being a member (retired or revoked): their own
    facts did not change, so no report would bring them back."""
    session.flush()
    for node in session.scalars(select(Node).where(
            Node.retired_at.is_(None), Node.admission == "admitted")
            .order_by(Node.node_id).with_for_update()).all():
        pools = _entries(node.node_facts)
        if not any("conflict" in p for p in pools):
            continue
        accepted = accept_pools(session, node, [dict(p) for p in pools], now)
        if accepted == pools:
            continue  # still refused: the node that has the pool ID first is a member
        node.node_facts = {**(node.node_facts or {}), "pools": accepted}
        register(session, node, accepted, now)
        nodes.bump(node)
        session.flush()
