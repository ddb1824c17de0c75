"""One pool ID, one storage: a second storage reporting the same pool ID with another
marker ``instance`` is refused (first one wins), listed unavailable for that node with a
reason naming both instances, logged, and never chosen by placement; pool availability
carried by a later ``report`` reaches placement without a new session."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from ctrl_helpers import wait_until
from sqlalchemy.orm import Session
from ws_helpers import TEMPLATE, events, open_ws_ctrl

from kibotos.ctrl.store.models import Node
from kibotos.testing.clock import ThreadAwareClock

FIRST = "a" * 32
SECOND = "b" * 32


def pool(instance: str | None, *, available: bool = True,
         reason: str | None = None) -> list[dict[str, Any]]:
    return [{"id": "shared-1", "shared": True, "default": True, "driver": "local",
             "available": available, "reason": reason, "instance": instance,
             "warnings": []}]


async def stored_pools(ctrl: Any, node_id: str) -> dict[str, dict[str, Any]]:
    def txn(session: Session) -> dict[str, dict[str, Any]]:
        node = session.get(Node, node_id)
        assert node is not None
        return {p["id"]: p for p in (node.node_facts or {}).get("pools", [])}

    return dict(await ctrl.ctx.store.run(txn))


async def refused_for(ctrl: Any, node_id: str, text: str) -> str:
    """A pinned create's refusal once it names `text` (placement's index follows the
    store a moment after the node view does, so an earlier refusal may name the clock)."""
    seen: list[str] = []

    async def names_it() -> bool:
        err = await ctrl.create(code="failed_precondition", node_id=node_id)
        seen.append(err["message"])
        return text in err["message"]

    await wait_until(names_it, f"a create pinned to {node_id} refused for {text!r}")
    return seen[-1]


async def test_second_storage_with_the_same_pool_id_is_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        autojump_clock: ThreadAwareClock) -> None:
    caplog.set_level(logging.WARNING, logger="kibotos.ctrl.pools")
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", pools=pool(FIRST))
        await ctrl.connect("node-b", pools=pool(SECOND))
        fact = (await stored_pools(ctrl, "node-b"))["shared-1"]
        assert fact["available"] is False
        assert FIRST in fact["reason"]
        assert SECOND in fact["reason"]
        assert "node-a joined first" in fact["reason"]
        assert (await stored_pools(ctrl, "node-a"))["shared-1"]["available"] is True
        assert any("storage pool refused" in r.getMessage() and FIRST in r.getMessage()
                   and SECOND in r.getMessage() for r in caplog.records)
        assert [e for e in await events(ctrl, "node-b")
                if e["kind"] == "storage_pool.refused"] == [
            {"kind": "storage_pool.refused", "pool_id": "shared-1", "instance": SECOND,
             "first_node_id": "node-a", "first_instance": FIRST}]
        # placement: node-b's pool is not available, pinned or not
        message = await refused_for(ctrl, "node-b", "default pool shared-1 is not available")
        assert FIRST in message
        for _ in range(3):
            assert (await ctrl.create())["node_id"] == "node-a"

        # the first node stays first across its own restart, even one whose marker
        # could not be read for a while (instance None)
        await ctrl.disconnect("node-a")
        await ctrl.connect("node-a", pools=pool(None, available=False,
                                                reason="storage pool marker is missing"))
        await ctrl.disconnect("node-b")
        await ctrl.connect("node-b", pools=pool(SECOND))
        assert (await stored_pools(ctrl, "node-b"))["shared-1"]["available"] is False
        await ctrl.nodes["node-a"].send_report(facts={"pools": pool(FIRST)})

        async def a_available() -> bool:
            return bool((await stored_pools(ctrl, "node-a"))["shared-1"]["available"])

        await wait_until(a_available, "node-a's pool available again from a report")
        assert (await stored_pools(ctrl, "node-b"))["shared-1"]["available"] is False


async def test_availability_in_a_report_reaches_placement(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        node = await ctrl.connect("node-a", pools=pool(
            None, available=False, reason="storage pool marker is missing"))
        await refused_for(ctrl, "node-a", "storage pool marker is missing")
        # `storage-pool init` on the node: the next report says available
        await node.send_report(facts={"pools": pool(FIRST)})

        async def available() -> bool:
            fact = (await stored_pools(ctrl, "node-a"))["shared-1"]
            return bool(fact["available"]) and fact["registered_instance"] == FIRST

        await wait_until(available, "pool available from the report")
        placed: list[dict[str, Any]] = []

        async def accepted() -> bool:  # the index follows the store a moment later
            resp = await ctrl.http.post("/v1/workspaces", headers=ctrl.operator, json={
                "template": TEMPLATE, "node_id": "node-a"})
            if resp.status_code == 200:
                placed.append(resp.json()["result"])
            return resp.status_code == 200

        await wait_until(accepted, "a create pinned to node-a accepted")
        assert placed[0]["node_id"] == "node-a"


async def test_a_retired_node_no_longer_holds_the_pool_id(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    """Moving a pool to new storage: isolate and retire the first node; the other
    storage is accepted on its next hello."""
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", pools=pool(FIRST))
        await ctrl.connect("node-b", pools=pool(SECOND))
        assert (await stored_pools(ctrl, "node-b"))["shared-1"]["available"] is False
        await ctrl.disconnect("node-a")
        await ctrl.call("POST", "/v1/nodes/node-a/isolate",
                        json={"confirm_host_cannot_write": True})
        await ctrl.call("POST", "/v1/nodes/node-a/retire", json={})
        await ctrl.disconnect("node-b")
        await ctrl.connect("node-b", pools=pool(SECOND))
        fact = (await stored_pools(ctrl, "node-b"))["shared-1"]
        assert fact["available"] is True
        assert fact["registered_instance"] == SECOND
