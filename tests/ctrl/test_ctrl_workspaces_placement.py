"""Placement through the API with simulated nodes: the policies, ``--node`` pinning and
its failures (drained, not attached to the pool, no capacity, unknown), memory-tight
fallback to the next node, resource_exhausted, and the drain flag sent to nodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ctrl_helpers import wait_until
from ws_helpers import GI, TEMPLATE, WsCtrl, open_ws_ctrl

from kibotos.testing.clock import ThreadAwareClock

SHARED = [{"id": "shared-1", "shared": True, "default": True}]


def creates(ctrl: WsCtrl, node_id: str) -> list[dict]:
    return [c for c in ctrl.sims[node_id].commands if c["kind"] == "instance.create"]


async def test_binpack_fills_the_fullest_node_first(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        for node_id in ("node-a", "node-b", "node-c"):
            await ctrl.connect(node_id)
        placed = [(await ctrl.create(cpu_millis=1000, memory_bytes=GI))["node_id"]
                  for _ in range(5)]
        # Ties go to the lower node ID; then the fullest node keeps taking them.
        assert placed == ["node-a", "node-a", "node-a", "node-a", "node-b"]


async def test_spread_puts_each_on_the_emptiest_node(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path, policy="spread") as ctrl:
        for node_id in ("node-a", "node-b", "node-c"):
            await ctrl.connect(node_id)
        placed = [(await ctrl.create(cpu_millis=1000, memory_bytes=GI))["node_id"]
                  for _ in range(4)]
        assert placed == ["node-a", "node-b", "node-c", "node-a"]


async def test_pinned_create_goes_there_and_only_there(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        for node_id in ("node-a", "node-b"):
            await ctrl.connect(node_id)
        ws = await ctrl.create(node_id="node-b")
        assert ws["node_id"] == "node-b"
        assert ws["layer"]["pool_id"] == "node-b-local"  # the node's default pool
        # Drained: refused, not placed elsewhere, and no node was asked.
        await ctrl.call("POST", "/v1/nodes/node-b/drain", json={})
        await ctrl.wait_eligible("node-b", False)
        err = await ctrl.create(code="failed_precondition", node_id="node-b")
        assert "drain requested" in err["message"]
        assert err["details"] == {"node_id": "node-b", "reason": "drain requested"}
        assert len(creates(ctrl, "node-a")) == 0
        assert len(creates(ctrl, "node-b")) == 1
        # No capacity: resource_exhausted, naming the shortage.
        err = await ctrl.create(code="resource_exhausted", node_id="node-a",
                                cpu_millis=4001)
        assert "not enough free CPU" in err["message"]
        err = await ctrl.create(code="resource_exhausted", node_id="node-a",
                                memory_bytes=9 * GI)
        assert "not enough free memory" in err["message"]
        assert len(creates(ctrl, "node-a")) == 0
        await ctrl.create(code="not_found", node_id="node-x")
        listed = await ctrl.call("GET", "/v1/workspaces")
        assert [w["workspace_id"] for w in listed["workspaces"]] == [ws["workspace_id"]]


async def test_pinned_start_needs_the_pool_and_is_not_remembered(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", pools=SHARED)
        await ctrl.connect("node-b", pools=SHARED)
        await ctrl.connect("node-c")  # only its private pool
        wid = (await ctrl.create(node_id="node-b"))["workspace_id"]
        ws = await ctrl.settled(wid)
        assert ws["node_id"] == "node-b"
        assert ws["layer"]["pool_id"] == "shared-1"
        await ctrl.action(wid, "stop")
        await ctrl.settled(wid)
        err = await ctrl.action(wid, "start", code="failed_precondition", node_id="node-c")
        assert "not attached to pool shared-1" in err["message"]
        assert creates(ctrl, "node-c") == []
        # Make node-a the fuller node: binpack now prefers it, and the earlier pin on
        # node-b is not remembered.
        other = await ctrl.create(node_id="node-a", cpu_millis=2000)
        await ctrl.settled(other["workspace_id"])
        started = await ctrl.action(wid, "start")
        assert started["node_id"] == "node-a"
        args = creates(ctrl, "node-a")[-1]["args"]
        assert args["layer"]["epoch"] == 2  # handed to another node: a new epoch
        assert args["layer"]["create"] is False
        await ctrl.settled(wid)


async def test_memory_tight_refusal_falls_back_to_the_next_node(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        await ctrl.connect("node-b")
        # node-a's memory turned tight, and ctrl has not heard of it yet.
        ctrl.sims["node-a"].memory_tight = True
        ws = await ctrl.create()
        assert ws["node_id"] == "node-b"
        assert len(creates(ctrl, "node-a")) == 1  # tried first, refused
        assert (await ctrl.settled(ws["workspace_id"]))["state"] == "AVAILABLE"
        # Pinned: nothing else is tried.
        err = await ctrl.create(code="resource_exhausted", node_id="node-a")
        assert "memory" in err["message"]
        # Nobody left: resource_exhausted.
        ctrl.sims["node-b"].memory_tight = True
        await ctrl.create(code="resource_exhausted")
        assert len((await ctrl.call("GET", "/v1/workspaces"))["workspaces"]) == 1
        # Once the node reports it cleared, it takes Workspaces again.
        await ctrl.sims["node-a"].set_memory_tight(False)
        await ctrl.sims["node-b"].set_memory_tight(False)
        await ctrl.wait_eligible("node-a")
        # The node's "eligible" is the stored record; the refusal hint in placement's
        # index clears when the report's commit reaches it, a moment later.  A refused
        # pinned create changes nothing, so try until that has happened.
        placed: dict[str, Any] = {}

        async def pinned_create_succeeds() -> bool:
            resp = await ctrl.http.post("/v1/workspaces", headers=ctrl.operator,
                                        json={"template": TEMPLATE, "node_id": "node-a"})
            placed.update(resp.json().get("result") or {})
            return resp.status_code == 200

        await wait_until(pinned_create_succeeds, "a pinned create on node-a")
        assert placed["node_id"] == "node-a"


async def test_memory_tight_report_keeps_placement_off(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        await ctrl.connect("node-b")
        await ctrl.sims["node-a"].set_memory_tight(True)
        await ctrl.wait_eligible("node-a", False)
        assert (await ctrl.create())["node_id"] == "node-b"
        assert creates(ctrl, "node-a") == []


async def test_no_capacity_anywhere_is_resource_exhausted(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        await ctrl.connect("node-b")
        await ctrl.call("POST", "/v1/nodes/node-b/drain", json={})
        await ctrl.wait_eligible("node-b", False)
        await ctrl.create(cpu_millis=3000)
        err = await ctrl.create(code="resource_exhausted", cpu_millis=3000)
        assert "1 node(s): drain requested" in err["message"]
        assert "1 node(s): not enough free CPU" in err["message"]
        # A replay of a capacity refusal is not journaled: it may succeed later.
        await ctrl.create(code="resource_exhausted", cpu_millis=3000, command_id="c1")
        await ctrl.call("POST", "/v1/nodes/node-b/cancel-drain", json={})
        await ctrl.wait_eligible("node-b")
        assert (await ctrl.create(cpu_millis=3000, command_id="c1"))["node_id"] == "node-b"


async def test_drain_and_cancel_are_sent_to_the_node(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        sim = ctrl.sims["node-a"]
        await ctrl.call("POST", "/v1/nodes/node-a/drain", json={})

        async def drained() -> bool:
            return sim.drain_requested

        await wait_until(drained, "node.drain{requested: true} reached the node")
        await ctrl.call("POST", "/v1/nodes/node-a/cancel-drain", json={})

        async def undrained() -> bool:
            return not sim.drain_requested

        await wait_until(undrained, "node.drain{requested: false} reached the node")
        drains = [c["args"] for c in sim.commands if c["kind"] == "node.drain"]
        assert drains == [{"requested": True}, {"requested": False}]
        # A reconnecting node learns the flag from the welcome.
        await ctrl.call("POST", "/v1/nodes/node-a/drain", json={})
        await wait_until(drained, "drained again")
        await ctrl.disconnect("node-a")
        sim.drain_requested = False
        node = await ctrl.connect("node-a", wait_eligible=False)
        assert node.first["drain_requested"] is True
        assert sim.drain_requested is True


@pytest.mark.parametrize("policy", ["binpack", "spread"])
async def test_unknown_policy_names_the_key(tmp_path: Path, policy: str) -> None:
    from ctrl_helpers import make_config

    from kibotos.core.errors import InvalidArgument
    from kibotos.ctrl.serve import build_context, build_services, open_store

    config = make_config(tmp_path, placement_policy=f"{policy}-typo")
    store = await open_store(config)
    try:
        with pytest.raises(InvalidArgument, match=r"ctrl\.placement_policy: unknown "
                                                  r"placement .*available: binpack, spread"):
            build_services(build_context(config, store))
    finally:
        store.close()
