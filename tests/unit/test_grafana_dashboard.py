"""contrib/grafana/kibotos.json queries only metrics the code defines.

The metric families are read from kibotos's source (every ``Counter``, ``Gauge``,
``Histogram`` and scrape-time ``*MetricFamily`` / ``_gauge`` call, with the names of
f-strings such as ``f"kibotos_node_{name}"`` resolved from the literal tuples their
loop walks), and the exposed sample names derived by type (a counter ``x`` is
``x_total``, a histogram ``x_bucket``, ``x_sum``, ``x_count``).  The reader is checked
against the registries of ctrl, the data plane and both gateways themselves, so that
it cannot miss a family silently; the dashboard then has to cover ctrl, the nodes,
the data plane, the E2B gateway and the Exposure gateway, and every name one of its
queries uses must be one of those samples."""

from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from kibotos.ctrl.api.metrics import CtrlMetrics
from kibotos.dataplane.process.metrics import DataplaneMetrics
from kibotos.gateway.e2b.metrics import GatewayMetrics
from kibotos.gateway.exposure.metrics import ExposureMetrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "contrib/grafana/kibotos.json"
#: Constructor -> the family's type.
KINDS = {"Counter": "counter", "CounterMetricFamily": "counter", "Gauge": "gauge",
         "GaugeMetricFamily": "gauge", "_gauge": "gauge", "Histogram": "histogram",
         "HistogramMetricFamily": "histogram"}
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
METRIC = re.compile(r"\bkibotos_[a-z0-9_]+\b")


def _loop_values(tree: ast.AST, variable: str) -> list[str]:
    """The string constants `variable` takes in a loop (or comprehension) over a literal
    tuple or list, bound alone or as the first name of a tuple target."""
    values: list[str] = []
    loops: list[tuple[ast.expr, ast.expr]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.For | ast.comprehension):
            loops.append((node.target, node.iter))
    for target, iterable in loops:
        if not isinstance(iterable, ast.Tuple | ast.List):
            continue
        names = target.elts if isinstance(target, ast.Tuple) else [target]
        for position, name in enumerate(names):
            if not (isinstance(name, ast.Name) and name.id == variable):
                continue
            for item in iterable.elts:
                element = item.elts[position] if isinstance(item, ast.Tuple) else item
                if isinstance(element, ast.Constant) and isinstance(element.value, str):
                    values.append(element.value)
    return values


def _names(tree: ast.AST, argument: ast.expr) -> list[str]:
    if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
        return [argument.value]
    if not isinstance(argument, ast.JoinedStr):
        return []
    names = [""]
    for part in argument.values:
        if isinstance(part, ast.Constant):
            names = [n + str(part.value) for n in names]
        elif isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name):
            names = [n + v for n in names for v in _loop_values(tree, part.value.id)]
        else:
            return []
    return names


@functools.cache
def families_in_source() -> dict[str, str]:
    """Family name -> type, for every metric family kibotos's source defines."""
    found: dict[str, str] = {}
    for path in sorted((REPO / "kibotos").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func = node.func
            called = func.id if isinstance(func, ast.Name) else (
                func.attr if isinstance(func, ast.Attribute) else "")
            if called in KINDS:
                for name in _names(tree, node.args[0]):
                    if name.startswith("kibotos_"):
                        found[name.removesuffix("_total")] = KINDS[called]
    return found


def samples(families: dict[str, str]) -> set[str]:
    return {name + suffix for name, kind in families.items() for suffix in SUFFIXES[kind]}


def _registry_families(registry: CollectorRegistry) -> dict[str, str]:
    return {f.name: f.type for f in registry.collect()}


def test_the_source_reader_finds_every_family_the_registries_hold() -> None:
    found = families_in_source()
    for metrics in (CtrlMetrics(), DataplaneMetrics(), GatewayMetrics(), ExposureMetrics()):
        for name, kind in _registry_families(metrics.registry).items():
            assert found.get(name) == kind, (name, kind, found.get(name))
    # Scrape-time families, f-strings resolved from their loops.
    for name in ("kibotos_node_vm_cpu_cores", "kibotos_node_cpu_pressure_ratio",
                 "kibotos_node_memory_pressure_ratio", "kibotos_ctrl_node_allocated_cpu_millis",
                 "kibotos_ctrl_workspaces", "kibotos_node_sessions_established"):
        assert name in found, name
    assert found["kibotos_node_sessions_established"] == "counter"
    assert "kibotos_node_" not in found


def _queries(dashboard: dict[str, object]) -> list[str]:
    exprs: list[str] = []

    def walk(value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key == "expr" and isinstance(item, str):
                    exprs.append(item)
                elif key == "query" and isinstance(item, dict | str):
                    walk({"expr": item["query"]} if isinstance(item, dict) else
                         {"expr": item})
                else:
                    walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(dashboard)
    return exprs


def test_every_metric_the_dashboard_queries_is_defined() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    defined = samples(families_in_source())
    queries = _queries(dashboard)
    used = {name for q in queries for name in METRIC.findall(q)}
    assert used, queries
    assert sorted(used - defined) == []
    # ctrl, the nodes, their data planes and both gateways all have panels.
    for prefix in ("kibotos_ctrl_", "kibotos_node_", "kibotos_dataplane_",
                   "kibotos_gateway_e2b_", "kibotos_gateway_exposure_"):
        assert any(name.startswith(prefix) for name in used), prefix


def test_a_misspelt_metric_would_be_caught() -> None:
    defined = samples(families_in_source())
    assert "kibotos_ctrl_http_requests_total" in defined
    assert "kibotos_ctrl_http_requests" not in defined      # a counter without _total
    assert "kibotos_ctrl_http_request_duration_seconds_bucket" in defined
    assert "kibotos_ctrl_http_request_duration_seconds" not in defined


def test_the_dashboard_is_well_formed() -> None:
    """Unique panel IDs, every query panel on the dashboard's Prometheus variable,
    nothing overlapping on the grid."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "node", "gateway", "exposure"} <= variables
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]
