"""Two ctrl replicas as real processes on a real PostgreSQL server, one simulated node
connected to the second: Workspaces created, stopped and deleted through the first
reach the node through the relay (`kibotos.ctrl.relay`), a command ID replayed on the
other replica returns the stored result, and a revoke through the first closes the
session the second holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from ctrl_helpers import result
from replica_pair import two_replicas
from replica_procs import sessions

from kibotos.testing.fake_node import open_sim_node
from kibotos.testing.sim_instances import SimInstances
from kibotos.testing.waiting import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


async def _settled(http: httpx.AsyncClient, headers: dict[str, str], workspace_id: str,
                   state: str) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        ws = result(await http.get(f"/v1/workspaces/{workspace_id}",
                                   params={"wait_s": 5}, headers=headers))
        return ws if ws["state"] == state else None
    return await wait_until(probe, f"{workspace_id} is {state}", timeout=60)


async def test_commands_through_one_replica_reach_a_node_on_the_other(
        tmp_path: Path, postgres_url: str) -> None:
    async with two_replicas(tmp_path, postgres_url, timeout=30) as pair:
        store, tls, via_a, via_b, operator = (pair.store, pair.tls, pair.via_a, pair.via_b,
                                              pair.operator)
        issued = await pair.node_credential("node-a")
        cred = issued["credential"]
        b = pair.b
        sim = SimInstances()
        async with open_sim_node(b.url, cred, "node-a", 1, sim=sim,
                                 ssl_context=tls) as node:
            assert node.welcomed
            held_by = (await sessions(store))["node-a"]["replica"]
            # Replica A learns of the node's session on B (and of B measuring its
            # clock) through the node-row notifications; until then it has no node
            # to place on.
            tries = iter(range(1000))

            async def create() -> tuple[dict[str, Any], dict[str, Any]] | None:
                body = {"template": "base", "command_id": f"create-{next(tries)}"}
                resp = await via_a.post("/v1/workspaces", json=body, headers=operator)
                if resp.status_code == 429:  # node not placeable from A yet (its
                    return None              # session, then its clock measured)
                return body, result(resp)
            body, created = await wait_until(create, "replica A places on node-a",
                                             timeout=30)
            assert created["node_id"] == "node-a"
            ws_id = created["workspace_id"]
            await _settled(via_a, operator, ws_id, "AVAILABLE")
            # The same command ID on the other replica: the stored result.
            replay = result(await via_b.post("/v1/workspaces", json=body,
                                             headers=operator))
            assert replay["workspace_id"] == ws_id
            assert replay["revision"] == created["revision"]

            result(await via_a.post(f"/v1/workspaces/{ws_id}/stop",
                                    json={"command_id": "stop-1"}, headers=operator))
            await _settled(via_a, operator, ws_id, "STOPPED")
            result(await via_a.post(f"/v1/workspaces/{ws_id}/delete",
                                    json={"command_id": "delete-1"}, headers=operator))
            await _settled(via_a, operator, ws_id, "DELETED")
            # The node was commanded through its own replica's session only.
            assert (await sessions(store))["node-a"]["replica"] == held_by
            kinds = [c.get("kind") for c in sim.commands]
            assert kinds[:2] == ["instance.create", "instance.stop"]
            assert "layer.delete" in kinds

            # Revoked through replica A: replica B, which holds the session, closes it.
            result(await via_a.post("/v1/enrollment/revoke",
                                    json={"id": issued["identity_id"]},
                                    headers=operator))
            with trio.fail_after(60):
                await node.closed.wait()
            assert node.close_reason == "revoked"
