"""The node's ``/metrics`` from a real ``kibotos node serve`` process enrolled with a real
ctrl on loopback: parsed with prometheus-client's parser, session/pool/host gauges,
memory tight following the host (and ctrl's placeable gauge with it), the data plane's
counters in the same scrape and never lower after a node restart (the data plane is
adopted), unknown paths refused, and the address file gone after a clean stop."""

from __future__ import annotations

import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import trio
from node_helpers import ctrl_endpoint, free_port, write_config, write_proc
from prometheus_client.parser import text_string_to_metric_families

from kibotos.config import CtrlConfig, load
from kibotos.ctrl.serve import serve_ctrl

pytestmark = pytest.mark.slow

KIBOTOS = [sys.executable, "-m", "kibotos.cli.main"]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> tuple[Samples, dict[str, str]]:
    values: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            values[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return values, types


def one(values: Samples, name: str, **labels: str) -> float | None:
    return values.get((name, frozenset(labels.items())))


async def grant(ctrl_toml: Path) -> str:
    proc = await trio.run_process(
        [*KIBOTOS, "ctrl", "grant", "--config", str(ctrl_toml), "--kind", "node",
         "--node-id", "node-a"], capture_stdout=True, capture_stderr=True)
    return proc.stdout.decode().strip()


async def read_address(path: Path) -> str:
    file = trio.Path(path)
    while not await file.exists():
        await trio.sleep(0.1)
    return (await file.read_text()).strip()


async def scrape_until(url: str, predicate: object,
                       verify: ssl.SSLContext | bool = True) -> Samples:
    """Scrape until `predicate(values)` holds (the caller's fail_after bounds it);
    `verify` checks an https:// endpoint (ctrl's)."""
    assert callable(predicate)
    async with httpx.AsyncClient(timeout=30, verify=verify) as http:
        while True:
            resp = await http.get(url)
            assert resp.status_code == 200, resp.text
            values, _ = parse(resp.text)
            if predicate(values):
                return values
            await trio.sleep(0.2)


async def test_node_metrics_from_a_real_node_process(tmp_path: Path) -> None:
    port = free_port()
    ctrl_toml = tmp_path / "ctrl.toml"
    ctrl_toml.write_text(f"""
[ctrl]
listen = "127.0.0.1:{port}"
state_dir = "{tmp_path / 'ctrl'}"
reconcile_interval = "0.5s"
[metrics]
refresh_interval = "0s"
""")
    grant_file = tmp_path / "grant"
    ctrl = ctrl_endpoint(ctrl_toml)
    toml = write_config(tmp_path, ctrl_url=ctrl.url, ctrl_ca_file=ctrl.ca_file,
                        grant_file=grant_file)
    toml.write_text(toml.read_text().replace(
        'dataplane_listen = "127.0.0.1:7500"',
        f'dataplane_listen = "127.0.0.1:{free_port()}"\nmetrics_listen = "127.0.0.1:0"'))
    address_file = tmp_path / "root" / "runtime" / "metrics-address"
    argv = [*KIBOTOS, "node", "serve", "--config", str(toml)]

    with trio.fail_after(180):
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: serve_ctrl(
                load(CtrlConfig, ctrl_toml), handle_signals=False, task_status=task_status))
            grant_file.write_text(await grant(ctrl_toml) + "\n")
            node = await trio.lowlevel.open_process(argv, stderr=subprocess.DEVNULL)
            try:
                url = f"http://{await read_address(address_file)}/metrics"
                values = await scrape_until(url, lambda v: one(
                    v, "kibotos_node_session_connected") == 1 and one(
                    v, "kibotos_dataplane_state_updates_total") is not None and one(
                    v, "kibotos_node_dataplane_certificate_expiry_seconds") is not None)
                async with httpx.AsyncClient(timeout=30) as http:
                    resp = await http.get(url)
                    _, types = parse(resp.text)
                    assert resp.headers["content-type"].startswith("text/plain")
                    assert (await http.get(url.replace("/metrics", "/v1/health"))
                            ).status_code == 404
                assert types["kibotos_node_instances"] == "gauge"
                assert types["kibotos_node_fencings"] == "counter"
                assert types["kibotos_dataplane_state_updates"] == "counter"
                assert one(values, "kibotos_node_instances", state="RUNNING") == 0
                assert one(values, "kibotos_node_pool_available", pool_id="pool-a") == 1
                assert one(values, "kibotos_node_memory_total_bytes") == 8_000_000 * 1024
                assert one(values, "kibotos_node_memory_tight") == 0
                assert one(values, "kibotos_node_fencings_total") == 0
                assert one(values, "kibotos_node_cleanup_pending") == 0
                assert one(values, "kibotos_node_drain_requested") == 0
                assert one(values, "kibotos_node_dataplane_metrics_up") == 1
                # The node obtained its data-plane certificate from ctrl (7 days).
                expiry = one(values, "kibotos_node_dataplane_certificate_expiry_seconds")
                assert expiry is not None
                assert time.time() + 6 * 86400 < expiry < time.time() + 8 * 86400
                assert (one(values, "kibotos_node_sessions_established_total") or 0) >= 1
                assert one(values, "kibotos_dataplane_connections_active") == 0

                # Host memory turns tight: the node's gauge, then ctrl's placeable.
                write_proc(tmp_path / "proc", available_kb=300_000, total_kb=8_000_000)
                await scrape_until(url, lambda v: one(v, "kibotos_node_memory_tight") == 1)
                await scrape_until(f"{ctrl.url}/metrics", lambda v: one(
                    v, "kibotos_ctrl_node_placeable", node_id="node-a") == 0, ctrl.tls)
                write_proc(tmp_path / "proc", available_kb=6_000_000, total_kb=8_000_000)
                await scrape_until(url, lambda v: one(v, "kibotos_node_memory_tight") == 0)

                # A clean stop removes the address file; the data plane keeps running.
                before = await scrape_until(url, lambda v: True)
                node.send_signal(signal.SIGTERM)
                assert await node.wait() == 0
                assert not address_file.exists()
                node = await trio.lowlevel.open_process(argv, stderr=subprocess.DEVNULL)
                url = f"http://{await read_address(address_file)}/metrics"
                after = await scrape_until(url, lambda v: one(
                    v, "kibotos_node_session_connected") == 1)
                dataplane = {k: v for k, v in before.items()
                             if k[0].startswith("kibotos_dataplane_") and k[0].endswith("_total")}
                assert dataplane
                for key, value in dataplane.items():
                    assert after.get(key, 0.0) >= value, (key, value, after.get(key))
            finally:
                if node.returncode is None:
                    node.send_signal(signal.SIGTERM)
                    await node.wait()
                # `kibotos node serve` started its data plane, which outlives the node.
                await trio.run_process([*KIBOTOS, "dataplane", "stop", "--config", str(toml)],
                                       capture_stdout=True, check=False)
            nursery.cancel_scope.cancel()
