"""Records of ended Instances between a real node and a real ctrl (spec:
node-and-vmm-processes, "Records of ended Instances"): a Workspace runs on the
``testvmm`` backend and is stopped; the node keeps the Instance's record in
``runtime/registry/`` until ctrl's sweep stored the cleanup result the node observed,
then ctrl has it deleted, and ``cleanup-status`` keeps reading the same result, with
the node's observation time."""

from __future__ import annotations

import base64
import hashlib
import shutil
import sys
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from instance_harness import short_dir, stop_all_units
from node_helpers import free_port, node_config

from kibotos.config import CtrlConfig, load
from kibotos.ctrl.serve import serve_ctrl
from kibotos.node.serve import serve_node
from kibotos.node.session import SessionTiming
from kibotos.plugins import EXTRA_MODULES_ENV

pytestmark = pytest.mark.slow

TIMING = SessionTiming(backoff_initial=0.05, backoff_cap=0.5)


async def _grant(ctrl_toml: Path, *args: str) -> str:
    proc = await trio.run_process(
        [sys.executable, "-m", "kibotos.cli.main", "ctrl", "grant", "--config",
         str(ctrl_toml), *args], capture_stdout=True, capture_stderr=True)
    return proc.stdout.decode().strip()


async def _operator(http: httpx.AsyncClient, ctrl_toml: Path) -> dict[str, str]:
    raw = Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    resp = await http.post("/v1/enrollment/exchange", json={
        "token": await _grant(ctrl_toml, "--kind", "operator"),
        "public_key": base64.b64encode(raw).decode()})
    assert resp.status_code == 200, resp.text
    return {"Authorization": f"Bearer {resp.json()['result']['credential']}"}


class Api:
    def __init__(self, http: httpx.AsyncClient, headers: dict[str, str]) -> None:
        self.http, self.headers = http, headers

    async def __call__(self, method: str, path: str, **kw: Any) -> Any:
        resp = await self.http.request(method, path, headers=self.headers, **kw)
        if method == "GET" and resp.status_code == 404:
            return None
        assert resp.status_code == 200, resp.text
        return resp.json().get("result") if resp.headers.get(
            "content-type", "").startswith("application/json") else None

    async def create(self, body: dict[str, Any]) -> Any:
        """Create a Workspace, again while placement has not seen the pool's capacity
        yet (a refused create changes nothing)."""
        while True:
            resp = await self.http.post("/v1/workspaces", headers=self.headers, json=body)
            if resp.status_code != 429:
                assert resp.status_code == 200, resp.text
                return resp.json()["result"]
            await trio.sleep(0.2)

    async def until(self, path: str, check: Any) -> Any:
        while True:
            got = await self("GET", path)
            if got is not None and check(got):
                return got
            await trio.sleep(0.1)


async def _upload_template(api: Api) -> None:
    """Three blobs ctrl accepts (an ext4 superblock magic, an ELF magic) and the
    Template naming them; the node fetches them from ctrl, the test VMM ignores them."""
    blobs = {"image_digest": bytes(1080) + b"\x53\xef" + bytes(62),
             "kernel_digest": b"\x7fELF" + bytes(60), "initramfs_digest": b"initramfs"}
    body = {}
    for key, blob in blobs.items():
        hexdigest = hashlib.sha256(blob).hexdigest()
        await api("PUT", f"/v1/artifacts/sha256/{hexdigest}", content=blob)
        body[key] = f"sha256:{hexdigest}"
    await api("PUT", "/v1/templates/tiny", json=body)


def _time(value: str) -> datetime:
    return datetime.fromisoformat(value)


async def test_ctrl_stores_the_observed_cleanup_then_the_node_deletes_the_record(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EXTRA_MODULES_ENV, "kibotos_testvmm")
    base = short_dir("kr-")
    port = free_port()
    ctrl_toml = base / "ctrl.toml"
    ctrl_toml.write_text(f"""
[ctrl]
listen = "127.0.0.1:{port}"
state_dir = "{base / 'ctrl'}"
reconcile_interval = "0.5s"
""")
    config = None
    try:
        with trio.fail_after(180):
            async with trio.open_nursery() as nursery:
                await nursery.start(partial(serve_ctrl, load(CtrlConfig, ctrl_toml),
                                            handle_signals=False))
                grant = base / "grant"
                grant.write_text(await _grant(ctrl_toml, "--kind", "node", "--node-id",
                                              "node-a"))
                config = node_config(base, ctrl_url=f"http://127.0.0.1:{port}",
                                     grant_file=grant, extra='[vmm]\nbackend = "testvmm"\n')
                await nursery.start(lambda task_status: serve_node(
                    config, sample_interval=0.05, timing=TIMING, task_status=task_status))
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                             timeout=60) as http:
                    api = Api(http, await _operator(http, ctrl_toml))
                    await _upload_template(api)
                    await api.until("/v1/nodes/node-a",
                                    lambda n: n["placement"]["eligible"])
                    await api.until("/v1/storage-pools/pool-a", lambda p: True)
                    await api("POST", "/v1/storage-pools/pool-a/set-capacity",
                              json={"capacity_bytes": 4 << 30})
                    ws = await api.create({"template": "tiny", "cpu_millis": 500,
                                           "memory_bytes": 128 << 20,
                                           "layer_size_bytes": 64 << 20})
                    wid = ws["workspace_id"]
                    path = f"/v1/workspaces/{wid}"
                    ws = await api.until(path, lambda w: w["state"] != "CREATING")
                    assert ws["state"] == "AVAILABLE", ws
                    instance_id = ws["instance"]["instance_id"]
                    record = config.storage.root / "runtime" / "registry" / \
                        f"{instance_id}.json"
                    assert not record.exists()
                    await api("POST", f"{path}/stop", json={})
                    stopped = await api.until(path, lambda w: w["state"] == "STOPPED")

                    # The sweep stores what the node observed, then the record goes.
                    status = await api.until(f"{path}/cleanup-status", lambda s: {
                        i["item"]: i["status"] for i in s["items"]}["RESIDUAL"] ==
                        "RELEASED")
                    with trio.fail_after(30):
                        while record.exists():
                            await trio.sleep(0.1)
                    items = {i["item"]: i for i in status["items"]}
                    assert {k: (v["status"], v["source"]) for k, v in items.items()} == \
                        dict.fromkeys(("RUNTIME", "VOLUME_ATTACHMENT", "RESIDUAL"),
                                      ("RELEASED", "node"))
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
                nursery.cancel_scope.cancel()
    finally:
        if config is not None:
            with trio.CancelScope(shield=True):
                await stop_all_units(config)
        shutil.rmtree(base, ignore_errors=True)
