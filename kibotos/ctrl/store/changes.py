"""What a committed transaction changed, as snapshots: the rows ctrl's in-memory
indexes follow.

Placement keeps every node's admission facts and every unreleased Allocation in memory
(`kibotos.ctrl.model.placement.CapacityIndex`), because reading a thousand node rows per
placement would cost more than the placement itself.  For such a cache to stay true to
the store, it must learn of *every* committed change, whoever made it.  This module
holds the synchronous half: the snapshot types (`Change`), how a written ORM object
becomes one (`snapshot`), and `note` for a write that bypasses the ORM's unit of work.
The trio half, `kibotos.ctrl.live.store_watch.StoreWatch`, listens to the store's
session events and delivers the snapshots of a transaction once it committed; keeping
it apart lets the synchronous model layer (placement, transactions) use these types
without importing trio.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from kibotos.ctrl.store.models import Allocation, ClusterSetting, Node, Template, Workspace

#: Where a transaction's snapshots wait in ``Session.info`` until it commits.
INFO_KEY = "kibotos.store_watch"
NODE_COLUMNS = tuple(c.key for c in Node.__table__.columns)


class NodeSnapshot:
    """The column values of one `Node` row at commit; satisfies `nodes.NodeFacts`."""

    __slots__ = NODE_COLUMNS
    node_id: str
    drain_requested: bool
    session_alive: bool

    def __init__(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            setattr(self, name, value)

    @classmethod
    def of(cls, node: Any) -> NodeSnapshot:
        return cls({name: getattr(node, name) for name in NODE_COLUMNS})


@dataclass(frozen=True)
class AllocationSnapshot:
    instance_id: str
    node_id: str
    cpu_millis: int
    memory_bytes: int
    released: bool


@dataclass(frozen=True)
class WorkspaceSnapshot:
    workspace_id: str
    state: str
    revision: int


@dataclass(frozen=True)
class TemplateSnapshot:
    """A Template row written or deleted (readers drop what they cached of it)."""

    name: str


@dataclass(frozen=True)
class SettingSnapshot:
    key: str
    value: dict[str, Any]
    version: int


Change = (NodeSnapshot | AllocationSnapshot | SettingSnapshot | WorkspaceSnapshot
          | TemplateSnapshot)
Subscriber = Callable[[list[Change]], None]


def snapshot(obj: object) -> tuple[tuple[str, str], Change] | None:
    if isinstance(obj, Node):
        return ("node", obj.node_id), NodeSnapshot.of(obj)
    if isinstance(obj, Allocation):
        return ("allocation", obj.instance_id), AllocationSnapshot(
            obj.instance_id, obj.node_id, int(obj.cpu_millis), int(obj.memory_bytes),
            obj.released_at is not None)
    if isinstance(obj, Template):
        return ("template", obj.name), TemplateSnapshot(obj.name)
    if isinstance(obj, Workspace):
        return ("workspace", obj.workspace_id), WorkspaceSnapshot(
            obj.workspace_id, obj.state, int(obj.revision))
    if isinstance(obj, ClusterSetting):
        return ("setting", obj.key), SettingSnapshot(obj.key, dict(obj.value),
                                                     int(obj.version))
    return None


def note(session: Session, obj: object) -> None:
    """Record `obj` as written in this transaction, for a write that bypasses the ORM's
    unit of work (a Core ``insert`` of rows built as model objects): it reaches the
    subscribers after the commit exactly as a flushed object would."""
    snap = snapshot(obj)
    if snap is not None:
        session.info.setdefault(INFO_KEY, {})[snap[0]] = snap[1]
