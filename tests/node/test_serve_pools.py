"""`serve_node` uses its pools: the layout at start, the availability monitor's facts in
hello and in every report, a later ``storage-pool init`` reaching ctrl without a
restart, and the Instance manager refusing objects of an unavailable pool."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
import trio
from node_helpers import Conn, FakeCtrl, node_config, store_identity

from kibotos.core.errors import Unavailable
from kibotos.node.serve import NodeRuntime, serve_node
from kibotos.node.session.control import SessionTiming
from kibotos.node.storage.objects import RETAINED_LAYERS
from kibotos.node.storage.pools.marker import init_pool, marker_path, read_marker

TIMING = SessionTiming(ping_interval=0.05, backoff_initial=0.02, backoff_cap=0.1)


async def test_marker_missing_then_init_reaches_ctrl_in_a_report(tmp_path: Path) -> None:
    reports: list[dict[str, Any]] = []
    got = trio.Event()

    async def script(conn: Conn) -> None:
        nonlocal got
        await conn.send(type="welcome", session_id="ses-1")
        while True:
            reports.append(await conn.receive_type("report"))
            got.set()
            got = trio.Event()

    with trio.fail_after(60):
        async with trio.open_nursery() as outer:
            fake = await outer.start(FakeCtrl(script).serve)
            config = node_config(tmp_path, ctrl_url=fake.ctrl_url)
            pool = config.storage.pool[0].path
            marker_path(pool).unlink()  # the operator forgot storage-pool init
            store_identity(config)
            async with trio.open_nursery() as nursery:
                runtime: NodeRuntime = await nursery.start(
                    lambda task_status: serve_node(config, timing=TIMING,
                                                   pool_interval=0.05,
                                                   task_status=task_status))
                await runtime.session.status.wait_until(lambda s: s.connected)
                [fact] = fake.conns[0].hello["facts"]["pools"]
                assert fact == {"id": "pool-a", "shared": False, "default": True,
                                "driver": "local", "available": False,
                                "reason": "storage pool marker is missing",
                                "instance": None, "warnings": []}
                # the layout is there (0710 for the VMM group), the pool is not usable
                assert stat.S_IMODE((pool / "volumes").stat().st_mode) == 0o710
                layers = runtime.instances.launcher.pools[  # type: ignore[attr-defined]
                    ("pool-a", RETAINED_LAYERS)]
                with pytest.raises(Unavailable, match="storage pool is unavailable: pool "
                                                      "pool-a: storage pool marker is "
                                                      "missing"):
                    await layers.open("ws-1", 1, create_capacity=16 << 20)

                init_pool("pool-a", pool, adopt=True)  # not empty any more: --adopt
                instance = read_marker(pool).instance  # type: ignore[union-attr]
                while not any(r["facts"]["pools"][0]["available"] for r in reports):
                    await got.wait()
                fact = next(r for r in reports if r["facts"]["pools"][0]["available"]
                            )["facts"]["pools"][0]
                assert fact["reason"] is None
                assert fact["instance"] == instance
                layers.check_available()  # usable now, no restart
                nursery.cancel_scope.cancel()
            outer.cancel_scope.cancel()
