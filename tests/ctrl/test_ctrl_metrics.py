"""ctrl's ``GET /metrics`` scraped over HTTP from a real ctrl on loopback with simulated
nodes: the text parses with prometheus-client's own parser, gauges and counters move
with real actions, counters never go down, unknown paths and methods do not add label
values, and ``[metrics] require_auth``/``enabled`` do what docs/metrics.md says."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ws_helpers import GI, WsCtrl, open_ws_ctrl

from kibotos.config import CtrlMetricsSection
from kibotos.ctrl.api.app import build_app
from kibotos.testing.clock import ThreadAwareClock

Key = tuple[str, frozenset[tuple[str, str]]]


class Scrape:
    """One scrape: sample values by (name, labels), and each family's type."""

    def __init__(self, text: str) -> None:
        self.values: dict[Key, float] = {}
        self.types: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for s in family.samples:
                self.values[(s.name, frozenset(s.labels.items()))] = float(s.value)

    def get(self, name: str, **labels: str) -> float | None:
        return self.values.get((name, frozenset(labels.items())))

    def labels(self, name: str, label: str) -> set[str]:
        return {dict(lb)[label] for n, lb in self.values if n == name and label in dict(lb)}

    def counters(self) -> dict[Key, float]:
        counter_families = {n for n, t in self.types.items() if t in ("counter", "histogram")}
        return {k: v for k, v in self.values.items()
                if not k[0].endswith("_created")
                and any(k[0].startswith(f) for f in counter_families)}


def fresh(ctrl: WsCtrl, **settings: object) -> None:
    """Store-derived gauges read at every scrape (and other `[metrics]` settings)."""
    section = CtrlMetricsSection.model_validate({"refresh_interval": 0, **settings})
    ctrl.ctx.config = ctrl.ctx.config.model_copy(update={"metrics": section})


async def scrape(ctrl: WsCtrl, headers: dict[str, str] | None = None) -> Scrape:
    resp = await ctrl.http.get("/metrics", headers=headers or {})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    return Scrape(resp.text)


def assert_not_decreased(before: Scrape, after: Scrape) -> None:
    for key, value in before.counters().items():
        assert after.values.get(key, 0.0) >= value, (key, value, after.values.get(key))


async def test_metrics_follow_nodes_workspaces_and_placements(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        fresh(ctrl)
        first = await scrape(ctrl)
        assert first.types["kibotos_ctrl_http_requests"] == "counter"
        assert first.get("kibotos_ctrl_nodes", status="READY") == 0
        assert first.get("kibotos_ctrl_workspaces", state="AVAILABLE") == 0
        assert first.get("kibotos_ctrl_node_sessions_live") == 0

        await ctrl.connect("node-a")
        created = await ctrl.create(cpu_millis=500, memory_bytes=GI, layer_size_bytes=2 * GI,
                                    command_id="metrics-test-create-1")
        ws = await ctrl.settled(created["workspace_id"])
        assert ws["state"] == "AVAILABLE"
        second = await scrape(ctrl)
        assert_not_decreased(first, second)
        assert second.get("kibotos_ctrl_nodes", status="READY") == 1
        assert second.get("kibotos_ctrl_node_status", node_id="node-a", status="READY") == 1
        assert second.get("kibotos_ctrl_node_placeable", node_id="node-a") == 1
        assert second.get("kibotos_ctrl_node_sessions_live") == 1
        assert second.get("kibotos_ctrl_node_allocated_cpu_millis", node_id="node-a") == 500
        assert second.get("kibotos_ctrl_node_allocated_memory_bytes", node_id="node-a") == GI
        assert second.get("kibotos_ctrl_workspaces", state="AVAILABLE") == 1
        assert second.get("kibotos_ctrl_instances", state="RUNNING") == 1
        pool = ws["layer"]["pool_id"]
        assert second.get("kibotos_ctrl_pool_reserved_bytes", pool_id=pool) == 2 * GI
        assert second.get("kibotos_ctrl_pool_capacity_bytes", pool_id=pool) == 2**40
        assert second.get("kibotos_ctrl_pool_members", pool_id=pool) == 1
        assert second.get("kibotos_ctrl_pool_available_members", pool_id=pool) == 1
        assert second.get("kibotos_ctrl_pool_lost", pool_id=pool) == 0
        assert (second.get("kibotos_ctrl_command_journal_entries") or 0) >= 1
        assert second.get("kibotos_ctrl_placements_total", operation="create",
                          outcome="placed") == 1
        assert second.get("kibotos_ctrl_placement_node_answers_total", answer="accepted") == 1
        assert (second.get("kibotos_ctrl_http_requests_total", route="/v1/workspaces",
                           method="POST", status="200") or 0) >= 1
        assert (second.get("kibotos_ctrl_http_request_duration_seconds_count",
                           route="/v1/workspaces", method="POST") or 0) >= 1
        assert (second.get("kibotos_ctrl_store_transaction_seconds_count",
                           outcome="commit") or 0) >= 1

        # A create no node can take: counted by its error code, nothing placed.
        await ctrl.create(code="resource_exhausted", cpu_millis=64_000)
        # A stop: the Workspace leaves AVAILABLE, its Allocation is released.
        await ctrl.action(ws["workspace_id"], "stop")
        assert (await ctrl.settled(ws["workspace_id"]))["state"] == "STOPPED"
        third = await scrape(ctrl)
        assert_not_decreased(second, third)
        assert third.get("kibotos_ctrl_placements_total", operation="create",
                         outcome="resource_exhausted") == 1
        assert third.get("kibotos_ctrl_workspaces", state="AVAILABLE") == 0
        assert third.get("kibotos_ctrl_workspaces", state="STOPPED") == 1
        assert third.get("kibotos_ctrl_node_allocated_cpu_millis", node_id="node-a") == 0

        # The node goes away: the READY count drops, OFFLINE rises, the pool has no
        # available member left.
        await ctrl.disconnect("node-a")
        fourth = await scrape(ctrl)
        assert_not_decreased(third, fourth)
        assert fourth.get("kibotos_ctrl_nodes", status="READY") == 0
        assert fourth.get("kibotos_ctrl_nodes", status="OFFLINE") == 1
        assert fourth.get("kibotos_ctrl_node_sessions_live") == 0
        assert fourth.get("kibotos_ctrl_pool_available_members", pool_id=pool) == 0


async def test_unknown_paths_and_methods_add_no_label_values(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        fresh(ctrl)
        for i in range(40):
            resp = await ctrl.http.get(f"/probe/{i}/x{i}")
            assert resp.status_code == 404
            await ctrl.http.request(f"FOO{i}", "/v1/health")
            resp = await ctrl.http.get(f"/v1/workspaces/ws-{i:026d}", headers=ctrl.operator)
            assert resp.status_code == 404
        got = await scrape(ctrl)
        routes = got.labels("kibotos_ctrl_http_requests_total", "route")
        assert "unmatched" in routes
        assert "/v1/workspaces/{workspace_id}" in routes
        assert not any("probe" in r or "ws-0" in r for r in routes), routes
        methods = got.labels("kibotos_ctrl_http_requests_total", "method")
        assert methods <= {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS",
                           "other"}, methods
        assert "other" in methods
        assert got.get("kibotos_ctrl_http_requests_total", route="unmatched", method="GET",
                       status="404") == 40
        assert got.get("kibotos_ctrl_http_requests_total",
                       route="/v1/workspaces/{workspace_id}", method="GET",
                       status="404") == 40


async def test_require_auth_and_disabled(tmp_path: Path, autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        fresh(ctrl, require_auth=True)
        resp = await ctrl.http.get("/metrics")
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "unauthenticated"
        await scrape(ctrl, ctrl.operator)

        # enabled = false: no /metrics route at all (read when the app is built).
        fresh(ctrl, enabled=False)
        transport = httpx.ASGITransport(app=build_app(ctrl.services))
        async with httpx.AsyncClient(transport=transport, base_url="http://ctrl") as http:
            resp = await http.get("/metrics", headers=ctrl.operator)
            assert resp.status_code == 404
            assert (await http.get("/v1/health")).status_code == 200


def test_metrics_settings_are_validated() -> None:
    from kibotos.config import CtrlConfig, parse
    from kibotos.core.errors import InvalidArgument

    got = parse(CtrlConfig, {"metrics": {"require_auth": True, "refresh_interval": "30s"}},
                "ctrl.toml")
    assert got.metrics.require_auth is True
    assert got.metrics.refresh_interval == 30.0
    assert CtrlConfig().metrics.enabled is True
    for bad, message in (({"metrics": {"listen": "x"}}, "metrics.listen: unknown key"),
                         ({"metrics": {"refresh_interval": "soon"}},
                          "metrics.refresh_interval: invalid duration")):
        with pytest.raises(InvalidArgument, match=re.escape(message)):
            parse(CtrlConfig, bad, "ctrl.toml")


def test_node_metrics_listen_is_validated(tmp_path: Path) -> None:
    from kibotos.config import NodeConfig, parse
    from kibotos.core.errors import InvalidArgument

    base = {"node": {"id": "node-a", "ctrl_url": "http://127.0.0.1:1"},
            "storage": {"root": str(tmp_path)}, "resources": {"cpu": 1, "memory": "1G"}}
    assert parse(NodeConfig, base, "node.toml").node.metrics_listen == ""
    ok = {**base, "node": {**base["node"], "metrics_listen": "127.0.0.1:9465"}}
    assert parse(NodeConfig, ok, "node.toml").node.metrics_listen == "127.0.0.1:9465"
    bad = {**base, "node": {**base["node"], "metrics_listen": "9465"}}
    with pytest.raises(InvalidArgument, match=re.escape("node.metrics_listen: expected host:port")):
        parse(NodeConfig, bad, "node.toml")


async def test_store_read_failure_serves_previous_values(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    from sqlalchemy import text

    async with open_ws_ctrl(tmp_path) as ctrl:
        fresh(ctrl)
        first = await scrape(ctrl)
        assert first.get("kibotos_ctrl_command_journal_entries") == 0
        assert first.get("kibotos_ctrl_metrics_store_read_failures_total") == 0

        def rename(old: str, new: str) -> object:
            return lambda session: session.execute(text(f"ALTER TABLE {old} RENAME TO {new}"))

        await ctrl.ctx.store.write(rename("commands", "commands_hidden"))
        try:
            second = await scrape(ctrl)
        finally:
            await ctrl.ctx.store.write(rename("commands_hidden", "commands"))
        assert second.get("kibotos_ctrl_metrics_store_read_failures_total") == 1
        # the previous read's values, not nothing
        assert second.get("kibotos_ctrl_command_journal_entries") == 0
        assert second.get("kibotos_ctrl_workspaces", state="AVAILABLE") == 0
        third = await scrape(ctrl)
        assert third.get("kibotos_ctrl_metrics_store_read_failures_total") == 1


async def test_require_auth_refuses_node_credentials(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        fresh(ctrl, require_auth=True)
        await ctrl.connect("node-a")
        resp = await ctrl.http.get("/metrics",
                                   headers={"Authorization": f"Bearer {ctrl.creds['node-a']}"})
        assert resp.status_code == 403
        assert resp.json()["error"]["code"] == "permission_denied"
