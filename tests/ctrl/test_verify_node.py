"""The store's own check of a chosen node (`workspace_txns.verify_node`, run in the
transaction that records a placement when several replicas share PostgreSQL): the
node's free room from its unreleased Allocations and its schedulable amount, with the
cluster-wide overcommit default as stored (or 1 without the row) and a node's override
taking precedence; a node no longer placeable is refused too."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy.orm import Session

from kibotos.ctrl.model import overcommit
from kibotos.ctrl.model import workspace_txns as tx
from kibotos.ctrl.store.db import Store
from kibotos.ctrl.store.models import Allocation, ClusterSetting, Node

NOW = datetime(2026, 12, 4, tzinfo=UTC)
GI = 1 << 30


def _node(session: Session) -> None:
    session.add(Node(node_id="node-a", created_at=NOW, session_id="ses-a", session_alive=True,
                     incarnation=1, resources_cpu_millis=4000, resources_memory_bytes=8 * GI,
                     clock_measured_at=NOW, session_started_at=NOW))
    for n, (cpu, released) in enumerate([(1000, False), (2000, False), (4000, True)]):
        session.add(Allocation(instance_id=f"inst-{n}", node_id="node-a",
                               workspace_id=f"ws-{n}", cpu_millis=cpu, memory_bytes=GI,
                               created_at=NOW, released_at=NOW if released else None))


async def _fits(store: Store, cpu: int, mem: int = GI) -> bool:
    try:
        await store.run(lambda s: tx.verify_node(s, "node-a", cpu, mem))
    except tx.Stale:
        return False
    return True


async def test_room_from_allocations_default_and_override(store: Store) -> None:
    await store.write(_node)
    # 3 of 4 CPUs held (the released 4 do not count); ratio 1 without a setting row.
    assert await _fits(store, 1000)
    assert not await _fits(store, 1001)
    assert not await _fits(store, 1000, 7 * GI)  # memory: 2 of 8 GiB held

    def default_2x(session: Session) -> None:
        session.add(ClusterSetting(key=overcommit.DEFAULT_KEY,
                                   value={"cpu": 2000, "memory": 1000}, version=2,
                                   updated_at=NOW))
    await store.write(default_2x)
    assert await _fits(store, 5000)
    assert not await _fits(store, 5001)

    def override(session: Session) -> None:
        node = session.get(Node, "node-a")
        assert node is not None
        node.overcommit_cpu = 1500
    await store.write(override)
    assert await _fits(store, 3000)
    assert not await _fits(store, 3001)


@pytest.mark.parametrize(("column", "value"), [
    ("drain_requested", True), ("session_alive", False), ("retired_at", NOW)])
async def test_a_node_no_longer_placeable_is_refused(store: Store, column: str,
                                                     value: object) -> None:
    await store.write(_node)
    assert await _fits(store, 500)

    def change(session: Session) -> None:
        node = session.get(Node, "node-a")
        assert node is not None
        setattr(node, column, value)
    await store.write(change)
    with pytest.raises(tx.Stale, match="no longer placeable"):
        await store.run(lambda s: tx.verify_node(s, "node-a", 500, GI))


async def test_an_unknown_node_is_gone(store: Store) -> None:
    with pytest.raises(tx.Stale, match="is gone"):
        await store.run(lambda s: tx.verify_node(s, "node-x", 500, GI))
