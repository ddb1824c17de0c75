"""Overcommit ratios (spec/nodes.txt, "overcommit"): bounds and decimals, the default
and per-node overrides, only the given item changes, and the confirm gate."""

from __future__ import annotations

import httpx
import pytest
from ctrl_helpers import enroll_node, error, read_node, result, update_node

from kibotos.ctrl.live.context import CtrlContext
from kibotos.ctrl.store.db import Store
from kibotos.ctrl.wire.base import NodeOut, OvercommitOut


async def _overview(client: httpx.AsyncClient, op: dict[str, str]) -> dict[str, object]:
    return dict(result(await client.get("/v1/overcommit", headers=op), OvercommitOut))


async def test_default_starts_at_one(client: httpx.AsyncClient,
                                     operator: dict[str, str]) -> None:
    assert await _overview(client, operator) == {
        "default": {"cpu": "1", "memory": "1"}, "version": 1, "overrides": []}


@pytest.mark.parametrize(("value", "shown"), [
    ("0", "0"), ("16", "16"), ("2.5", "2.5"), ("0.125", "0.125"), ("16.000", "16"),
    ("16.001", None), ("-1", None), ("0.0005", None), ("1.2345", None),
    ("abc", None), ("nan", None), ("inf", None), ("", None),
])
async def test_ratio_bounds_and_decimals(client: httpx.AsyncClient, operator: dict[str, str],
                                         value: str, shown: str | None) -> None:
    resp = await client.put("/v1/overcommit/default", headers=operator, json={"cpu": value})
    if shown is not None:
        assert result(resp)["default"]["cpu"] == shown
    else:
        assert "cpu" in error(resp, "invalid_argument")["message"]
        assert (await _overview(client, operator))["version"] == 1


async def test_set_default_changes_only_the_given_item(client: httpx.AsyncClient,
                                                       operator: dict[str, str]) -> None:
    out = result(await client.put("/v1/overcommit/default", headers=operator,
                                  json={"cpu": "4", "expected_version": 1}), OvercommitOut)
    assert out["default"] == {"cpu": "4", "memory": "1"}
    assert out["version"] == 2
    out = result(await client.put("/v1/overcommit/default", headers=operator,
                                  json={"memory": "1.5", "expected_version": 2}))
    assert out["default"] == {"cpu": "4", "memory": "1.5"}
    assert out["version"] == 3
    err = error(await client.put("/v1/overcommit/default", headers=operator,
                                 json={"cpu": "2", "expected_version": 2}), "aborted")
    assert err["details"]["version"] == 3
    error(await client.put("/v1/overcommit/default", headers=operator, json={}),
          "invalid_argument")
    error(await client.put("/v1/overcommit/default", headers=operator,
                           json={"cpu": "default"}), "invalid_argument")
    assert (await _overview(client, operator))["default"] == {"cpu": "4", "memory": "1.5"}


async def test_node_override_and_default(client: httpx.AsyncClient, operator: dict[str, str],
                                         store: Store) -> None:
    await enroll_node(client, operator, "node-a")
    await update_node(store, "node-a", resources_cpu_millis=4000,
                      resources_memory_bytes=8 << 30)
    result(await client.put("/v1/overcommit/default", headers=operator, json={"cpu": "4"}))
    node = result(await client.put("/v1/nodes/node-a/overcommit", headers=operator,
                                   json={"cpu": "2.5", "memory": "0.9",
                                         "expected_version": 1}), NodeOut)
    assert node["overcommit"]["cpu"] == {"ratio": "2.5", "source": "override"}
    assert node["overcommit"]["memory"] == {"ratio": "0.9", "source": "override"}
    assert node["schedulable"] == {"cpu_millis": 10_000,
                                   "memory_bytes": (8 << 30) * 900 // 1000}
    assert node["registration_version"] == 2
    node = result(await client.put("/v1/nodes/node-a/overcommit", headers=operator,
                                   json={"cpu": "default", "expected_version": 2}))
    assert node["overcommit"]["cpu"] == {"ratio": "4", "source": "default"}
    assert node["overcommit"]["memory"] == {"ratio": "0.9", "source": "override"}
    assert node["schedulable"]["cpu_millis"] == 16_000
    overview = await _overview(client, operator)
    assert overview["overrides"] == [{"node_id": "node-a", "cpu": None, "memory": "0.9",
                                      "registration_version": 3}]
    error(await client.put("/v1/nodes/node-a/overcommit", headers=operator,
                           json={"memory": "1", "expected_version": 2}), "aborted")
    result(await client.put("/v1/nodes/node-a/overcommit", headers=operator,
                            json={"memory": "default"}))
    assert (await _overview(client, operator))["overrides"] == []
    error(await client.put("/v1/nodes/node-x/overcommit", headers=operator,
                           json={"cpu": "1"}), "not_found")


async def test_a_changed_ratio_waits_for_the_node(client: httpx.AsyncClient,
                                                  operator: dict[str, str], store: Store,
                                                  ctx: CtrlContext) -> None:
    """Until the node acknowledges the new serial, it is not placeable."""
    for name in ("node-a", "node-b"):
        await enroll_node(client, operator, name)
        await update_node(store, name, session_alive=True, session_id="s", incarnation=1,
                          session_started_at=ctx.now(), clock_offset_ms=0.0,
                          clock_uncertainty_ms=1.0, clock_measured_at=ctx.now())
    assert result(await client.get("/v1/nodes/node-a", headers=operator))["placement"][
        "eligible"]
    node = result(await client.put("/v1/nodes/node-a/overcommit", headers=operator,
                                   json={"memory": "1.2"}))
    assert node["overcommit"]["confirmed"] is False
    assert node["placement"] == {"eligible": False,
                                 "reason": "overcommit change not yet confirmed by the node"}
    # Setting the same value again is no change: nothing new to confirm.
    serial = (await read_node(store, "node-a")).overcommit_sent_serial
    result(await client.put("/v1/nodes/node-a/overcommit", headers=operator,
                            json={"memory": "1.2"}))
    assert (await read_node(store, "node-a")).overcommit_sent_serial == serial
    # A default change reaches nodes that use the default for that item only.
    result(await client.put("/v1/overcommit/default", headers=operator, json={"memory": "2"}))
    assert (await read_node(store, "node-a")).overcommit_sent_serial == serial
    node_b = await read_node(store, "node-b")
    assert node_b.overcommit_sent_serial == 1
    assert node_b.overcommit_confirmed_serial == 0
    result(await client.put("/v1/overcommit/default", headers=operator, json={"cpu": "3"}))
    assert (await read_node(store, "node-a")).overcommit_sent_serial == serial + 1
