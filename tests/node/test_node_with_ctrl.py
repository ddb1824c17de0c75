"""A real node against a real ctrl on loopback: enrollment with a grant from
`kibotos ctrl grant`, READY in `GET /v1/nodes/{id}`, clock and usage measured by ctrl,
overcommit confirmed, memory tight reported, a ctrl restart survived with a new session
and the same incarnation, and the isolate cycle (old incarnation refused and told,
a new one clearing the isolate)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from ctrl_api_harness import ctrl_grant, operator_headers
from node_helpers import ctrl_endpoint, free_port, node_config, write_proc

from kibotos.config import CtrlConfig, load
from kibotos.ctrl.serve import serve_ctrl
from kibotos.node.serve import NodeRuntime, serve_node
from kibotos.node.session.control import NodeIsolated, SessionTiming
from kibotos.testing.waiting import wait_until

pytestmark = pytest.mark.slow

TIMING = SessionTiming(backoff_initial=0.05, backoff_cap=0.5)


def _ctrl_toml(tmp_path: Path, port: int) -> Path:
    path = tmp_path / "ctrl.toml"
    path.write_text(f"""
[ctrl]
listen = "127.0.0.1:{port}"
state_dir = "{tmp_path / 'ctrl'}"
reconcile_interval = "0.2s"
""")
    return path


async def _wait_node(http: httpx.AsyncClient, headers: dict[str, str],
                     predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll `GET /v1/nodes/node-a` until `predicate` holds (the caller's fail_after
    bounds the wait more tightly)."""

    async def probe() -> dict[str, Any] | None:
        resp = await http.get("/v1/nodes/node-a", headers=headers)
        if resp.status_code != 200:
            return None
        node: dict[str, Any] = resp.json()["result"]
        return node if predicate(node) else None

    return await wait_until(probe, "node-a as the test expects it", timeout=120)


async def _start_node(nursery: trio.Nursery, config: Any) -> NodeRuntime:
    runtime: NodeRuntime = await nursery.start(lambda task_status: serve_node(
        config, sample_interval=0.05, timing=TIMING, task_status=task_status))
    return runtime


async def test_node_enrolls_reports_and_survives_a_ctrl_restart(tmp_path: Path) -> None:
    port = free_port()
    ctrl_toml = _ctrl_toml(tmp_path, port)
    ctrl_config = load(CtrlConfig, ctrl_toml)
    ctrl = ctrl_endpoint(ctrl_toml)
    grant_file = tmp_path / "grant"
    skew_file = tmp_path / "skew"
    with trio.fail_after(120):
        async with trio.open_nursery() as outer, \
                httpx.AsyncClient(base_url=ctrl.url, timeout=30, verify=ctrl.tls) as http:
            ctrl_scope = trio.CancelScope()

            async def run_ctrl(*, task_status: trio.TaskStatus[str]) -> None:
                with ctrl_scope:
                    await serve_ctrl(ctrl_config, handle_signals=False, task_status=task_status)

            await outer.start(run_ctrl)
            grant_file.write_text(await ctrl_grant(ctrl_toml, "--kind", "node",
                                               "--node-id", "node-a") + "\n")
            operator = await operator_headers(http, ctrl_toml)
            config = node_config(tmp_path, ctrl_url=ctrl.url, ctrl_ca_file=ctrl.ca_file,
                                 grant_file=grant_file, skew_file=skew_file)
            runtime = await _start_node(outer, config)
            assert runtime.incarnation == 1
            assert (tmp_path / "root" / "pki" / "identity.json").exists()

            # READY, with the session's facts, a clock reading and a usage sample.
            node = await _wait_node(http, operator, lambda n: (
                n["status"] == "READY" and n["latest_session"]["clock"] is not None
                and n["host_usage"] is not None))
            session = node["latest_session"]
            assert session["incarnation"] == 1
            assert session["session_id"] == runtime.session.status.session_id
            assert session["release_version"] == "unreleased"
            assert session["alive"] is True
            assert session["clock"]["over"] is False
            assert session["clock"]["sync_status"] in ("synchronized", "unsynchronized",
                                                       "unknown")
            assert node["resources"] == {"cpu_millis": 2500, "memory_bytes": 4 * 2**30}
            assert node["dataplane_address"] == "https://127.0.0.1:7500"
            assert node["host_usage"]["memory_total_bytes"] == 8_000_000 * 1024
            assert node["host_usage"]["vm_cpu_cores"] is None

            # The clock gate follows the skew the node reports, measured by reconciliation.
            skew_file.write_text("45")
            node = await _wait_node(http, operator, lambda n: n["latest_session"]["clock"]["over"])
            assert node["latest_session"]["clock"]["offset_ms"] > 30_000
            skew_file.write_text("0")
            await _wait_node(http, operator, lambda n: not n["latest_session"]["clock"]["over"])

            # A new ratio reaches the node and is confirmed.
            version = node["registration_version"]
            resp = await http.put("/v1/nodes/node-a/overcommit", headers=operator,
                                  json={"cpu": "2.5", "expected_version": version})
            assert resp.status_code == 200, resp.text
            await runtime.session.status.wait_until(
                lambda s: s.overcommit is not None and s.overcommit["cpu"] == "2.5")
            node = await _wait_node(http, operator, lambda n: n["overcommit"]["confirmed"])
            assert node["overcommit"]["cpu"] == {"ratio": "2.5", "source": "override"}

            # Memory tight (below 10 %) is reported at once, and clears above 15 %.
            write_proc(config.host.proc_root, available_kb=500_000, total_kb=8_000_000)
            node = await _wait_node(http, operator, lambda n: n["memory_tight"])
            assert node["memory_tight_since"] is not None
            write_proc(config.host.proc_root, available_kb=2_000_000, total_kb=8_000_000)
            await _wait_node(http, operator, lambda n: not n["memory_tight"])

            # ctrl restarts on the same address: the node comes back on its own, with a
            # new session and the same incarnation.
            first_session = runtime.session.status.session_id
            ctrl_scope.cancel()
            await runtime.session.status.wait_until(lambda s: not s.connected)
            ctrl_scope = trio.CancelScope()
            await outer.start(run_ctrl)
            await runtime.session.status.wait_until(
                lambda s: s.connected and s.session_id != first_session)
            node = await _wait_node(http, operator, lambda n: (
                n["status"] == "READY"
                and n["latest_session"]["session_id"] == runtime.session.status.session_id))
            assert node["latest_session"]["incarnation"] == 1
            assert node["overcommit"]["cpu"]["ratio"] == "2.5"  # nothing lost
            outer.cancel_scope.cancel()


async def test_isolate_cycle(tmp_path: Path) -> None:
    port = free_port()
    ctrl_toml = _ctrl_toml(tmp_path, port)
    ctrl = ctrl_endpoint(ctrl_toml)
    grant_file = tmp_path / "grant"
    with trio.fail_after(120):
        async with trio.open_nursery() as outer, \
                httpx.AsyncClient(base_url=ctrl.url, timeout=30, verify=ctrl.tls) as http:
            await outer.start(partial(serve_ctrl, load(CtrlConfig, ctrl_toml),
                                      handle_signals=False))
            grant_file.write_text(await ctrl_grant(ctrl_toml, "--kind", "node",
                                               "--node-id", "node-a"))
            operator = await operator_headers(http, ctrl_toml)
            config = node_config(tmp_path, ctrl_url=ctrl.url, ctrl_ca_file=ctrl.ca_file,
                                 grant_file=grant_file)

            async with trio.open_nursery() as node_nursery:
                await _start_node(node_nursery, config)
                node = await _wait_node(http, operator, lambda n: n["status"] == "READY")
                # Refused while the node's session lives.
                resp = await http.post("/v1/nodes/node-a/isolate", headers=operator,
                                       json={"confirm_host_cannot_write": True})
                assert resp.status_code == 412, resp.text
                node_nursery.cancel_scope.cancel()  # the host goes dark

            node = await _wait_node(http, operator, lambda n: n["status"] == "OFFLINE")
            resp = await http.post("/v1/nodes/node-a/isolate", headers=operator,
                                   json={"confirm_host_cannot_write": True,
                                         "expected_version": node["registration_version"]})
            assert resp.status_code == 200, resp.text
            assert resp.json()["result"]["node"]["status"] == "ISOLATED"

            # The host comes back still believing it is incarnation 1 (its state was not
            # advanced): ctrl tells it it was isolated, and it ends for a restart.
            (tmp_path / "root" / "state" / "incarnation").unlink()
            with pytest.raises(NodeIsolated):
                await serve_node(config, timing=TIMING)
            node = await _wait_node(http, operator, lambda n: True)
            assert node["status"] == "ISOLATED"

            # systemd restarts it: incarnation 2 clears the isolate.
            async with trio.open_nursery() as node_nursery:
                runtime = await _start_node(node_nursery, config)
                assert runtime.incarnation == 2
                node = await _wait_node(http, operator, lambda n: n["status"] == "READY")
                assert node["isolated"] is False
                assert node["latest_session"]["incarnation"] == 2
                node_nursery.cancel_scope.cancel()
            outer.cancel_scope.cancel()

