"""A real ctrl on loopback (hypercorn, SQLite) with an operator and enrolled node
credentials, for the node tests that talk to its artifact store (test_template_cache,
test_node_transfer)."""

from __future__ import annotations

import base64
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypercorn.trio import serve as hypercorn_serve

from kibotos.config import CtrlConfig
from kibotos.ctrl.api.app import build_app
from kibotos.ctrl.live.context import utcnow
from kibotos.ctrl.model import enrollment
from kibotos.ctrl.serve import (
    build_context,
    build_services,
    hypercorn_config,
    open_store,
    prepare_tls,
)
from kibotos.ctrl.store.artifacts import artifact_root
from kibotos.tls import local_ctrl
from kibotos.tls.local_ctrl import client_tls


@dataclass
class LoopbackCtrl:
    url: str  # https://: the certificate ctrl issues from its cluster CA
    #: The cluster CA file, and a context verifying ctrl with it.
    ca_file: Path
    tls: ssl.SSLContext
    http: httpx.AsyncClient
    operator: dict[str, str]
    #: Node ID → that node's credential.
    credentials: dict[str, str]
    #: Where ctrl keeps the artifacts (``…/sha256``).
    artifacts: Path


async def _exchange(http: httpx.AsyncClient, token: str) -> str:
    raw = Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    resp = await http.post("/v1/enrollment/exchange", json={
        "token": token, "public_key": base64.b64encode(raw).decode()})
    assert resp.status_code == 200, resp.text
    return str(resp.json()["result"]["credential"])


@asynccontextmanager
async def loopback_ctrl(tmp_path: Path, nodes: Sequence[str]) -> AsyncIterator[LoopbackCtrl]:
    """ctrl with its state under `tmp_path`, an operator credential and one credential
    per node of `nodes`; stopped at the end."""
    config = CtrlConfig.model_validate({"ctrl": {
        "listen": "127.0.0.1:0", "state_dir": str(tmp_path / "ctrl"),
        "reconcile_interval": "1h"}})
    store = await open_store(config)
    ctx = build_context(config, store)
    try:
        async with trio.open_nursery() as nursery:
            tls = prepare_tls(config, ctx)
            binds = await nursery.start(partial(
                hypercorn_serve, build_app(build_services(ctx)),
                hypercorn_config(config.ctrl.listen, tls)))
            verify = client_tls(config)
            async with httpx.AsyncClient(base_url=binds[0], timeout=60, verify=verify) as http:
                grant = await store.write(partial(
                    enrollment.create_grant, kind="operator", node_id=None, name="op",
                    expires_in_s=None, created_by=None, now=utcnow()))
                operator = {"Authorization": f"Bearer {await _exchange(http, grant['token'])}"}
                creds = {}
                for node in nodes:
                    resp = await http.post("/v1/enrollment/grants", headers=operator,
                                           json={"kind": "node", "node_id": node})
                    creds[node] = await _exchange(http, resp.json()["result"]["token"])
                ca = local_ctrl.ca_file(config)
                assert ca is not None
                yield LoopbackCtrl(binds[0], ca, verify, http, operator, creds,
                                   artifact_root(config) / "sha256")
            nursery.cancel_scope.cancel()
    finally:
        store.close()
