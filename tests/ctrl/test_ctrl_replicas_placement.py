"""Placement across two ctrl replicas (real processes, a real PostgreSQL server), one
simulated node on each: each replica places on the node whose session it holds first,
turns to the other's node only when its own is full, and knows the Allocations the
other replica committed (`kibotos.ctrl.store.allocation_notes`) without waiting for its
minute resync, so it never asks a node the other replica filled; and new overcommit
ratios set through one replica reach a node whose session the other holds at once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from ctrl_helpers import result
from replica_pair import two_replicas
from replica_procs import sessions

from kibotos.testing.fake_node import open_sim_node
from kibotos.testing.sim_instances import SimInstances
from kibotos.testing.waiting import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

#: A pinned create's refusals that mean "that replica does not see the node ready yet"
#: (its session, then its clock measured, learnt through the relay).
NOT_YET = ("no live control session", "clock not measured in this session yet")
#: A node takes four of these (the simulated node has 4 CPUs).
CPU = 1000


def _creates(sim: SimInstances) -> int:
    return sum(c.get("kind") == "instance.create" for c in sim.commands)


async def test_each_replica_fills_its_own_nodes_first_and_sees_the_others(
        tmp_path: Path, postgres_url: str) -> None:
    async with two_replicas(tmp_path, postgres_url) as pair:
        store, tls, via_a, via_b, operator = (pair.store, pair.tls, pair.via_a, pair.via_b,
                                              pair.operator)
        creds = {n: (await pair.node_credential(n))["credential"]
                 for n in ("node-a", "node-b")}
        sim_a, sim_b = SimInstances(), SimInstances()
        async with open_sim_node(pair.a.url, creds["node-a"], "node-a", 1, sim=sim_a,
                                 ssl_context=tls) as node_a, \
                open_sim_node(pair.b.url, creds["node-b"], "node-b", 1, sim=sim_b,
                              ssl_context=tls) as node_b:
            assert node_a.welcomed
            assert node_b.welcomed
            held = await sessions(store)
            assert held["node-a"]["replica"] != held["node-b"]["replica"]
            counter = iter(range(1000))

            async def create(via: httpx.AsyncClient, **body: Any) -> httpx.Response:
                return await via.post("/v1/workspaces", headers=operator, json={
                    "template": "base", "cpu_millis": CPU,
                    "command_id": f"create-{next(counter)}", **body})

            def pinned(via: httpx.AsyncClient, node_id: str
                       ) -> Callable[[], Awaitable[dict[str, Any] | None]]:
                async def probe() -> dict[str, Any] | None:
                    resp = await create(via, node_id=node_id)
                    if resp.status_code != 200 and any(why in resp.text for why in NOT_YET):
                        return None  # not placeable from there yet
                    placed: dict[str, Any] = result(resp)
                    return placed
                return probe

            # One on each node through the replica that does not hold it, once that
            # replica sees the node (through the relay).
            await wait_until(pinned(via_a, "node-b"), "A places on node-b", timeout=30)
            await wait_until(pinned(via_b, "node-a"), "B places on node-a", timeout=30)
            # Binpack alone would pick by its ranking among equals; each replica
            # takes its own node.
            assert result(await create(via_b))["node_id"] == "node-b"
            for _ in range(3):  # node-a full
                assert result(await create(via_a))["node_id"] == "node-a"
            # A's own node is full: the next goes to node-b, through the relay.
            assert result(await create(via_a))["node_id"] == "node-b"
            assert result(await create(via_b))["node_id"] == "node-b"  # full
            # B has nothing left, and knows from A's notices that node-a is full
            # (its own index resyncs only every minute): node-a is not asked.
            asked_a = _creates(sim_a)
            resp = await create(via_b)
            assert resp.status_code == 429, resp.text
            assert "not enough free CPU" in resp.text
            assert _creates(sim_a) == asked_a, "B asked node-a, which A filled"
            assert (asked_a, _creates(sim_b)) == (4, 4)

            # An overcommit override for node-b set through A: B, which holds the
            # session, pushes it at once (the node-row notice), the node confirms,
            # and node-b takes more (before, it waited for the node's next welcome,
            # and no replica placed on node-b meanwhile).
            node = result(await via_a.put("/v1/nodes/node-b/overcommit",
                                          headers=operator, json={"cpu": "2"}))
            assert node["overcommit"]["confirmed"] is False

            async def confirmed() -> bool:
                node = result(await via_a.get("/v1/nodes/node-b", headers=operator))
                return bool(node["overcommit"]["confirmed"])
            await wait_until(confirmed, "node-b confirms the ratio set through A",
                             timeout=10)
            bigger = await wait_until(pinned(via_b, "node-b"), "node-b takes more",
                                      timeout=10)
            assert bigger["node_id"] == "node-b"
