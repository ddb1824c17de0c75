"""Records of ended Instances between a real node and a real ctrl (spec:
node-and-vmm-processes, "Records of ended Instances"): a Workspace runs on the
``testvmm`` backend and is stopped; the node keeps the Instance's record in
``runtime/registry/`` until ctrl's sweep stored the cleanup result the node observed,
then ctrl has it deleted, and ``cleanup-status`` keeps reading the same result, with
the node's observation time."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from ctrl_api_harness import Api, ctrl_grant, operator_headers, upload_template
from instance_harness import short_dir, stop_all_units
from node_helpers import ctrl_endpoint, free_port, node_config
from stuck_fuse_helpers import StuckFs

from kibotos.config import CtrlConfig, NodeConfig, load
from kibotos.ctrl.serve import serve_ctrl
from kibotos.node.serve import NodeRuntime, serve_node
from kibotos.node.session.control import SessionTiming
from kibotos.plugins import EXTRA_MODULES_ENV

pytestmark = pytest.mark.slow

TIMING = SessionTiming(backoff_initial=0.05, backoff_cap=0.5)


def _time(value: str) -> datetime:
    return datetime.fromisoformat(value)


@asynccontextmanager
async def cluster(monkeypatch: pytest.MonkeyPatch, *, modules: str = "kibotos_testvmm",
                  vmm: str = 'backend = "testvmm"\n', extra: str = ""
                  ) -> AsyncIterator[tuple[Api, NodeConfig, NodeRuntime, Path]]:
    """ctrl and one node (in this process), the Template uploaded, the node placeable."""
    monkeypatch.setenv(EXTRA_MODULES_ENV, modules)
    base = short_dir("kr-")
    port = free_port()
    ctrl_toml = base / "ctrl.toml"
    ctrl_toml.write_text(f"""
[ctrl]
listen = "127.0.0.1:{port}"
state_dir = "{base / 'ctrl'}"
reconcile_interval = "0.5s"
""")
    ctrl = ctrl_endpoint(ctrl_toml)
    config = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(serve_ctrl, load(CtrlConfig, ctrl_toml),
                                        handle_signals=False))
            grant = base / "grant"
            grant.write_text(await ctrl_grant(ctrl_toml, "--kind", "node", "--node-id",
                                          "node-a"))
            config = node_config(base, ctrl_url=ctrl.url, ctrl_ca_file=ctrl.ca_file,
                                 grant_file=grant, extra=f"[vmm]\n{vmm}{extra}")
            runtime: NodeRuntime = await nursery.start(lambda task_status: serve_node(
                config, sample_interval=0.05, timing=TIMING, task_status=task_status))
            async with httpx.AsyncClient(base_url=ctrl.url, verify=ctrl.tls,
                                         timeout=60) as http:
                api = Api(http, await operator_headers(http, ctrl_toml))
                await upload_template(api)
                await api.until("/v1/nodes/node-a", lambda n: n["placement"]["eligible"])
                await api.until("/v1/storage-pools/pool-a", lambda p: True)
                await api("POST", "/v1/storage-pools/pool-a/set-capacity",
                          json={"capacity_bytes": 4 << 30})
                yield api, config, runtime, base
            nursery.cancel_scope.cancel()
    finally:
        if config is not None:
            with trio.CancelScope(shield=True):
                await stop_all_units(config)
        shutil.rmtree(base, ignore_errors=True)


async def available(api: Api) -> tuple[str, str]:
    ws = await api.create({"template": "tiny", "cpu_millis": 500,
                           "memory_bytes": 128 << 20, "layer_size_bytes": 64 << 20})
    ws = await api.until(f"/v1/workspaces/{ws['workspace_id']}",
                         lambda w: w["state"] != "CREATING")
    assert ws["state"] == "AVAILABLE", ws
    return ws["workspace_id"], ws["instance"]["instance_id"]


def statuses(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {i["item"]: (i["status"], i["source"]) for i in status["items"]}


async def test_ctrl_stores_the_observed_cleanup_then_the_node_deletes_the_record(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with trio.fail_after(180):
        async with cluster(monkeypatch) as (api, config, _runtime, _base):
            wid, instance_id = await available(api)
            path = f"/v1/workspaces/{wid}"
            record = config.storage.root / "runtime" / "registry" / f"{instance_id}.json"
            assert not record.exists()
            await api("POST", f"{path}/stop", json={})
            stopped = await api.until(path, lambda w: w["state"] == "STOPPED")

            # The sweep stores what the node observed, then the record goes.
            status = await api.until(f"{path}/cleanup-status",
                                     lambda s: statuses(s)["RESIDUAL"][0] == "RELEASED")
            with trio.fail_after(30):
                while record.exists():
                    await trio.sleep(0.1)
            assert statuses(status) == dict.fromkeys(
                ("RUNTIME", "VOLUME_ATTACHMENT", "RESIDUAL"), ("RELEASED", "node"))
            observed = {i["observed_at"] for i in status["items"]}
            assert len(observed) == 1
            # The node's moment, before ctrl heard of the STOPPED Instance.
            assert _time(observed.pop()) <= _time(stopped["updated_at"])
            assert status["pending_since"] is None
            assert status["held"] == []
            # Later sweeps leave the stored result as it is.
            await trio.sleep(1.5)
            again = await api("GET", f"{path}/cleanup-status")
            assert again["items"] == status["items"]
            # The machine's log tails stay on the node.
            assert (config.storage.root / "machine-logs" / instance_id /
                    "vmm.log").is_file()


@pytest.mark.skipif(not Path("/dev/fuse").exists() or shutil.which("mount") is None,
                    reason="needs /dev/fuse and mount(8)")
async def test_cleanup_status_shows_a_release_stuck_on_the_node(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The VMM leaves a process SIGKILL cannot end (`stuck_fuse.py`): the Workspace
    stays STOPPING, cleanup-status says since when and what is held, and once the
    process is gone the node finishes and the stop completes."""
    mountpoint = Path(short_dir("kf-"))
    fs = StuckFs(mountpoint)
    try:
        with trio.fail_after(240):
            async with cluster(
                    monkeypatch, modules="kibotos_testvmm,kibotos_stuckvmm",
                    vmm='backend = "stuckvmm"\nstop_timeout = "1s"\n',
                    extra=f'[vmm.stuckvmm]\nstuck_path = "{mountpoint / "block"}"\n'
                          '[supervisor]\nbackend = "direct"\n'
                          '[supervisor.direct]\nkill_grace = 0.5\n'
                    ) as (api, _config, runtime, _base):
                manager = runtime.instances
                manager.cleanups.retry_s = 0.3  # type: ignore[attr-defined]
                manager.cleanups.command_wait_s = 0.5  # type: ignore[attr-defined]
                wid, instance_id = await available(api)
                await fs.wait_held()
                path = f"/v1/workspaces/{wid}"
                await api("POST", f"{path}/stop", json={"force": True})
                status = await api.until(f"{path}/cleanup-status",
                                         lambda s: s["pending_since"] is not None)
                assert (await api("GET", path))["state"] == "STOPPING"
                assert statuses(status) == {"RUNTIME": ("PENDING", "node"),
                                            "VOLUME_ATTACHMENT": ("PENDING", "node"),
                                            "RESIDUAL": ("IN_USE", "node")}
                held = {h["item"]: h["part"] for h in status["held"]}
                assert "survived SIGKILL" in held["RUNTIME"]
                assert held["VOLUME_ATTACHMENT"].startswith("writable layer ")
                since = status["pending_since"]
                # Still pending a while later, with the same start.
                await trio.sleep(1.0)
                again = await api("GET", f"{path}/cleanup-status")
                assert again["pending_since"] == since
                assert (await api("GET", path))["state"] == "STOPPING"

                fs.release()  # the storage answers: the stuck process ends
                ws = await api.until(path, lambda w: w["state"] == "STOPPED")
                assert ws["instance"]["confirmed_on_disk"] is False
                done = await api.until(f"{path}/cleanup-status",
                                       lambda s: statuses(s)["RESIDUAL"][0] == "RELEASED")
                assert done["pending_since"] is None
                assert done["held"] == []
                assert statuses(done)["RUNTIME"] == ("RELEASED", "node")
                assert manager.holdings().instance_count == 0
                assert instance_id not in str(manager.holdings().instances)
    finally:
        fs.release()
        shutil.rmtree(mountpoint, ignore_errors=True)
