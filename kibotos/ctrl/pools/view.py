"""Storage pools as ``kibo storage-pool list|get|objects`` show them (JSON).

A pool is what ctrl knows about one pool ID: its ``storage_pools`` row (capacity,
registered instance, lost state) and what its members report.  Members are the nodes
that declare the pool in their latest facts and are neither retired nor revoked
(spec/nodes.txt, "retire"); each has its own availability with a reason, which is the
node's own verdict on the pool, ctrl's refusal of a second storage with the same pool
ID, or the node's state when it has no live session (a pool on a node that cannot be
reached is not available to placement either).  Nodes report pool changes at once and
re-check every 30 s, so what ``get`` shows is at most about a minute old.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.core.errors import NotFound
from kibotos.ctrl.model import nodes
from kibotos.ctrl.pools import capacity as pool_capacity
from kibotos.ctrl.pools import facts as pool_facts
from kibotos.ctrl.store.models import Node, StoragePool
from kibotos.ctrl.wire.base import iso


def member_entries(session: Session) -> dict[str, list[tuple[Node, dict[str, Any]]]]:
    """pool ID -> (member node, the pool entry it reported), in node ID order."""
    out: dict[str, list[tuple[Node, dict[str, Any]]]] = {}
    for node in session.scalars(select(Node).order_by(Node.node_id)):
        if not pool_facts.is_member(node):
            continue
        pools = (node.node_facts or {}).get("pools")
        for entry in pools if isinstance(pools, list) else ():
            if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                out.setdefault(entry["id"], []).append((node, entry))
    return out


def _member_json(node: Node, entry: dict[str, Any]) -> dict[str, Any]:
    available = bool(entry.get("available", True))
    reason = entry.get("reason") if isinstance(entry.get("reason"), str) else None
    status = nodes.status(node)
    if available and node.isolated_incarnation is not None:
        available, reason = False, f"node {node.node_id} is isolated"
    elif available and not node.session_alive:
        available, reason = False, (f"node {node.node_id} is {status}: no live control "
                                    "session")
    return {"node_id": node.node_id, "node_status": status, "available": available,
            "reason": None if available else reason,
            "shared": bool(entry.get("shared", False)),
            "default": bool(entry.get("default", False)),
            "driver": entry.get("driver"), "instance": entry.get("instance"),
            "refused": "conflict" in entry,
            "warnings": list(entry.get("warnings") or [])}


def _refused_json(node: Node, entry: dict[str, Any]) -> dict[str, Any]:
    conflict = entry.get("conflict") or {}
    return {"node_id": node.node_id, "instance": entry.get("instance"),
            "reason": entry.get("reason"), "first_node_id": conflict.get("node_id"),
            "first_instance": conflict.get("instance")}


def pool_json(session: Session, pool_id: str, row: StoragePool | None,
              members: list[tuple[Node, dict[str, Any]]]) -> dict[str, Any]:
    reserved = pool_capacity.reserved_bytes(session, pool_id)
    capacity = row.capacity_bytes if row is not None else None
    shared = any(bool(e.get("shared", False)) for _, e in members)
    member_list = [_member_json(n, e) for n, e in members]
    registered = row.registered_node_id if row is not None else None
    if registered is not None and registered not in {n.node_id for n, _ in members}:
        registered = None  # retired, revoked, or no longer declares it
    return {
        "pool_id": pool_id,
        "mode": "shared" if shared else "standalone",
        "shared": shared,
        "capacity_bytes": capacity,
        "reserved_bytes": reserved,
        "free_bytes": None if capacity is None else max(capacity - reserved, 0),
        "instance": row.instance if row is not None else None,
        "registered_node_id": registered,
        "lost": row is not None and row.lost_at is not None,
        "lost_at": iso(row.lost_at) if row is not None else None,
        "lost_instance": row.lost_instance if row is not None else None,
        "revision": row.revision if row is not None else 0,
        "created_at": iso(row.created_at) if row is not None else None,
        "updated_at": iso(row.updated_at) if row is not None else None,
        "members": member_list,
        "available_members": sum(1 for m in member_list if m["available"]),
        "refused": [_refused_json(n, e) for n, e in members if "conflict" in e],
    }


def list_pools(session: Session) -> dict[str, Any]:
    """Every pool ID ctrl knows (a row, or a member reporting it), in ID order."""
    rows = {r.pool_id: r for r in session.scalars(select(StoragePool))}
    members = member_entries(session)
    return {"pools": [pool_json(session, pid, rows.get(pid), members.get(pid, []))
                      for pid in sorted(set(rows) | set(members))]}


def get_pool(session: Session, pool_id: str) -> dict[str, Any]:
    row = session.get(StoragePool, pool_id)
    members = member_entries(session).get(pool_id, [])
    if row is None and not members:
        raise NotFound(f"storage pool {pool_id} does not exist: no node has declared it",
                       details={"pool_id": pool_id})
    return pool_json(session, pool_id, row, members)


def pool_objects(session: Session, pool_id: str) -> dict[str, Any]:
    get_pool(session, pool_id)  # not_found for an unknown pool
    return {"pool_id": pool_id, "objects": pool_capacity.objects(session, pool_id)}
