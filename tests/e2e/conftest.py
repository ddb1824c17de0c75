"""End-to-end tests run against a real dev cluster: ctrl and node processes on loopback.

The ``dev_cluster`` fixture starts one per test (3 nodes, the test inputs of docs/dev.md,
a short reconcile interval and session timeout so the tests need not sit through
production periods) and always stops it again.  ``@pytest.mark.cluster(nodes=2, …)``
passes other options to `DevCluster.up`.  When a test fails, the end of every log is
printed with it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from e2e_links import remove_short_links_into

from kibotos.dev import DevCluster
from kibotos.dev.procs import tail
from kibotos.testing.waiting import wait_until_sync

DEFAULTS: dict[str, Any] = {
    "nodes": 3,
    "reconcile_interval": "2s",
    "session_timeout": "5s",
    "test_inputs": True,
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cluster(**options): options for the dev_cluster fixture (DevCluster.up)")


@pytest.fixture
def dev_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DevCluster]:
    marker = request.node.get_closest_marker("cluster")
    options = {**DEFAULTS, **(marker.kwargs if marker else {})}
    cluster = DevCluster(tmp_path / "cluster", timeout=120)
    try:
        cluster.up(**options)
        yield cluster
    finally:
        try:
            cluster.down(grace=10)
        finally:
            for svc in cluster.services():
                print(f"----- {svc.log} (last lines)\n{tail(svc.log, 40)}")
            remove_short_links_into(tmp_path)


def _kibo_json(cluster: DevCluster, *args: str, code: int = 0, **kw: Any) -> Any:
    proc = cluster.kibo(*args, "--json", **kw)
    assert proc.returncode == code, (
        f"kibo {' '.join(args)} exited {proc.returncode}, expected {code}\n"
        f"stdout: {proc.stdout}\nstderr: {proc.stderr}")
    return json.loads(proc.stdout) if proc.stdout.strip() else None


@pytest.fixture
def kibo_json() -> Callable[..., Any]:
    """``kibo_json(cluster, *args, code=0)``: run ``kibo … --json``, check the exit code,
    return the parsed stdout (``{"result": …}`` or ``{"error": …}``)."""
    return _kibo_json


@pytest.fixture
def wait_until() -> Callable[..., Any]:
    """``wait_until(probe, what, timeout=90)``: poll until `probe()` is truthy, return it;
    fail the test naming `what` after the timeout (no timed assertions: deadlines are
    generous and only bound a hang)."""
    return partial(wait_until_sync, timeout=90.0, interval=0.5)


def _table(stdout: str) -> dict[str, dict[str, str]]:
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in stdout.splitlines() if line.startswith("|")]
    header, body = rows[0], rows[1:]
    return {row[0]: dict(zip(header, row, strict=True)) for row in body}


@pytest.fixture
def kibo_table() -> Callable[[str], dict[str, dict[str, str]]]:
    """Parse the ASCII table `kibo` prints when stdout is not a terminal into
    ``{first cell: {column: cell}}``."""
    return _table
