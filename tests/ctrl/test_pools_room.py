"""A create's one-statement room read (`pool_capacity.room`, and `reserved_bytes` in
its transaction) agrees with the full sum (`snapshot`, which reads every Workspace,
Volume and operation): with no operation running, and with an expansion and a move
running, when it falls back to the Volume half's own rules."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy.orm import Session

from kibotos.ctrl.model import workspace_records as w
from kibotos.ctrl.pools import capacity as pool_capacity
from kibotos.ctrl.store.db import Store
from kibotos.ctrl.store.models import ObjectOperation, StoragePool, Volume

NOW = datetime(2026, 12, 3, tzinfo=UTC)
GI = 1 << 30
TEMPLATE = {"name": "base", "image_digest": "sha256:" + "a" * 64,
            "kernel_digest": "sha256:" + "b" * 64, "initramfs_digest": "sha256:" + "c" * 64}


def _fill(session: Session) -> None:
    for pool_id, capacity in (("pool-a", 100 * GI), ("pool-b", None), ("pool-c", 5 * GI)):
        session.add(StoragePool(pool_id=pool_id, capacity_bytes=capacity, revision=1,
                                created_at=NOW, updated_at=NOW))
    for n, (pool_id, size, state) in enumerate([
            ("pool-a", 2 * GI, w.AVAILABLE), ("pool-a", 3 * GI, w.STOPPED),
            ("pool-a", 7 * GI, w.DELETED), ("pool-b", 1 * GI, w.CREATING)]):
        ws = w.new_workspace(workspace_id=f"ws-{n}", template=TEMPLATE, labels={},
                             cpu_millis=250, memory_bytes=GI, layer_size_bytes=size,
                             layer_pool_id=pool_id, layer_ref=f"lay-{n}", now=NOW)
        ws.state = state
        session.add(ws)
    for n, (pool_id, size, state) in enumerate([
            ("pool-a", 4 * GI, "AVAILABLE"), ("pool-b", 6 * GI, "AVAILABLE"),
            ("pool-b", 9 * GI, "DELETED")]):
        session.add(Volume(volume_id=f"vol-{n}", pool_id=pool_id, capacity_bytes=size,
                           state=state, labels={}, revision=1, created_at=NOW,
                           updated_at=NOW))


async def _agree(store: Store) -> dict[str, int]:
    snap = await store.run(pool_capacity.snapshot)
    seen = {}
    for pool_id in ("pool-a", "pool-b", "pool-c", "pool-unknown"):
        room = await store.run(lambda s, p=pool_id: pool_capacity.room(s, p))
        reserved = await store.run(lambda s, p=pool_id: pool_capacity.reserved_bytes(s, p))
        expected = snap.get(pool_id, pool_capacity.Room(pool_id, None, 0))
        assert room == expected, pool_id
        assert reserved == expected.reserved_bytes
        seen[pool_id] = reserved
    return seen


async def test_the_room_read_agrees_with_the_full_sum(store: Store) -> None:
    await store.write(_fill)
    assert await _agree(store) == {"pool-a": 9 * GI, "pool-b": 7 * GI, "pool-c": 0,
                             "pool-unknown": 0}

    def operations(session: Session) -> None:
        session.add(ObjectOperation(  # an expansion of vol-0 to 10 GiB
            object_kind="volume", object_id="vol-0", op="expand", status="running",
            pool_id="pool-a", capacity_bytes=4 * GI, target_capacity_bytes=10 * GI,
            created_at=NOW, updated_at=NOW))
        session.add(ObjectOperation(  # vol-1 on its way to pool-c
            object_kind="volume", object_id="vol-1", op="move", status="running",
            pool_id="pool-b", capacity_bytes=6 * GI, target_pool_id="pool-c",
            created_at=NOW, updated_at=NOW))

    await store.write(operations)
    assert await _agree(store) == {"pool-a": 15 * GI, "pool-b": 7 * GI, "pool-c": 6 * GI,
                             "pool-unknown": 0}
