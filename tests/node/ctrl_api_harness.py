"""A real ctrl's operator API as the node tests that run a node against it use it
(test_node_with_ctrl, test_registry_sweep_with_ctrl, test_upgrade_with_ctrl): grants
from ``kibotos ctrl grant``, an operator credential, a small API client, and a
Template whose blobs ctrl accepts."""

from __future__ import annotations

import base64
import hashlib
import sys
from pathlib import Path
from typing import Any

import httpx
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


async def ctrl_grant(ctrl_toml: Path, *args: str) -> str:
    """A grant from ``kibotos ctrl grant`` with `args` (``--kind``, ``--node-id``)."""
    proc = await trio.run_process(
        [sys.executable, "-m", "kibotos.cli.main", "ctrl", "grant", "--config",
         str(ctrl_toml), *args], capture_stdout=True, capture_stderr=True)
    return proc.stdout.decode().strip()


async def operator_headers(http: httpx.AsyncClient, ctrl_toml: Path) -> dict[str, str]:
    """The headers of a fresh operator credential (an operator grant exchanged)."""
    raw = Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    resp = await http.post("/v1/enrollment/exchange", json={
        "token": await ctrl_grant(ctrl_toml, "--kind", "operator"),
        "public_key": base64.b64encode(raw).decode()})
    assert resp.status_code == 200, resp.text
    return {"Authorization": f"Bearer {resp.json()['result']['credential']}"}


class Api:
    """Operator calls: the result of a 200, None for a GET that is 404."""

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
        """GET `path` until it exists and `check` holds (the caller bounds the wait)."""
        while True:
            got = await self("GET", path)
            if got is not None and check(got):
                return got
            await trio.sleep(0.1)


async def upload_template(api: Api) -> None:
    """Three blobs ctrl accepts (an ext4 superblock magic, an ELF magic) and the
    Template ``tiny`` naming them; the node fetches them from ctrl, the test VMM ignores
    them."""
    blobs = {"image_digest": bytes(1080) + b"\x53\xef" + bytes(62),
             "kernel_digest": b"\x7fELF" + bytes(60), "initramfs_digest": b"initramfs"}
    body = {}
    for key, blob in blobs.items():
        hexdigest = hashlib.sha256(blob).hexdigest()
        await api("PUT", f"/v1/artifacts/sha256/{hexdigest}", content=blob)
        body[key] = f"sha256:{hexdigest}"
    await api("PUT", "/v1/templates/tiny", json=body)
