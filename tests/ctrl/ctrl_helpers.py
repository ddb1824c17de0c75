"""Helpers of the ctrl tests: enrolling identities the real way, reading results, and
checking that every answer has the documented shape.  `wait_until` is the shared one of
`kibotos.testing.waiting`, re-exported."""

from __future__ import annotations

import base64
import ssl
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel
from sqlalchemy.orm import Session

from kibotos.config import CtrlConfig
from kibotos.core.errors import ERROR_CLASSES
from kibotos.ctrl.live.context import CtrlContext, utcnow
from kibotos.ctrl.model import enrollment
from kibotos.ctrl.store.db import Store
from kibotos.ctrl.store.models import Node
from kibotos.testing.fake_node import SimNode, open_sim_node
from kibotos.testing.waiting import wait_until as wait_until  # re-exported for the ctrl tests


def make_config(tmp_path: Path, database_url: str = "", *, pool_capacity: str | None = "1T",
                **ctrl: object) -> CtrlConfig:
    """`pool_capacity`: ctrl's ``[testing] pool_capacity`` (None: pools start with no
    capacity, as in production, and a create needs ``set-capacity`` first)."""
    section = {"listen": "127.0.0.1:0", "state_dir": str(tmp_path / "state"),
               "database_url": database_url, **ctrl}
    return CtrlConfig.model_validate({"ctrl": section,
                                      "testing": {"pool_capacity": pool_capacity}})


def public_key() -> str:
    key = Ed25519PrivateKey.generate().public_key()
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def bearer(credential: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {credential}"}


def result(resp: httpx.Response, model: type[BaseModel] | None = None) -> Any:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == {"result"}, body
    if model is not None:
        model.model_validate(body["result"])
    return body["result"]


def error(resp: httpx.Response, code: str) -> dict[str, Any]:
    body = resp.json()
    assert "error" in body, body
    assert body["error"]["code"] == code, body
    assert resp.status_code == ERROR_CLASSES[code].http_status, (resp.status_code, body)
    return dict(body["error"])


async def grant_direct(store: Store, kind: str, node_id: str | None = None,
                       expires_in_s: float | None = None) -> str:
    """A grant written straight into the store, as `kibotos ctrl grant` does."""
    issued = await store.write(partial(
        enrollment.create_grant, kind=kind, node_id=node_id, name=f"test {kind}",
        expires_in_s=expires_in_s, created_by=None, now=utcnow()))
    return str(issued["token"])


async def exchange(client: httpx.AsyncClient, token: str) -> dict[str, Any]:
    resp = await client.post("/v1/enrollment/exchange",
                             json={"token": token, "public_key": public_key()})
    return dict(result(resp))


async def enroll_operator(client: httpx.AsyncClient, store: Store) -> dict[str, str]:
    issued = await exchange(client, await grant_direct(store, "operator"))
    return bearer(issued["credential"])


async def enroll_node(client: httpx.AsyncClient, operator: dict[str, str],
                      node_id: str) -> str:
    """Create a node grant through the API, exchange it; returns the node's credential."""
    grant = result(await client.post("/v1/enrollment/grants", headers=operator,
                                     json={"kind": "node", "node_id": node_id}))
    issued = await exchange(client, grant["token"])
    assert issued["node_id"] == node_id
    return str(issued["credential"])


async def update_node(store: Store, node_id: str, **fields: Any) -> None:
    """Set registration facts directly, standing in for a session in API-only tests."""

    def txn(session: Session) -> None:
        node = session.get(Node, node_id)
        assert node is not None
        for name, value in fields.items():
            setattr(node, name, value)

    await store.write(txn)


async def read_node(store: Store, node_id: str) -> Node:
    node = await store.run(lambda s: s.get(Node, node_id))
    assert node is not None
    return node


@dataclass
class RunningCtrl:
    """A ctrl app with an enrolled operator: served by hypercorn on 127.0.0.1 (`url` is
    real), or in-process (`connect` opens in-memory streams to its session endpoint,
    `http` drives it through ``httpx.ASGITransport``, and `url` only names it)."""

    config: CtrlConfig
    ctx: CtrlContext
    url: str
    connect: Callable[[], Awaitable[trio.abc.Stream]] | None = None
    #: Verifies a real ctrl's certificate (an https `url`); None in-process.
    tls: ssl.SSLContext | None = None
    #: The ASGI app being served (``running_ctrl``), for a test that adds a route.
    app: Any = None
    http: httpx.AsyncClient = field(init=False)
    operator: dict[str, str] = field(init=False)

    def sim_node(self, credential: str, node_id: str, incarnation: int,
                 **kwargs: Any) -> AbstractAsyncContextManager[SimNode]:
        """`open_sim_node` against this ctrl, over whichever transport it has."""
        return open_sim_node(self.url, credential, node_id, incarnation,
                             connect=self.connect, ssl_context=self.tls, **kwargs)

    async def node(self, node_id: str) -> dict[str, Any]:
        return dict(result(await self.http.get(f"/v1/nodes/{node_id}",
                                               headers=self.operator)))

    async def enroll(self, node_id: str) -> str:
        return await enroll_node(self.http, self.operator, node_id)
