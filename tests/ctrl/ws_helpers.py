"""Helpers of the Workspace tests: a real ctrl app (SQLite) with its Workspace service
running, a Template in the store, and simulated nodes (`kibotos.testing.fake_node`) that
answer the Instance commands.  ctrl runs in-process (no socket; the autojump clock
applies) unless a test asks for hypercorn on 127.0.0.1:0 (`open_ws_ctrl`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio
from ctrl_helpers import enroll_node, enroll_operator, make_config, wait_until
from hypercorn.trio import serve as hypercorn_serve
from sqlalchemy.orm import Session

from kibotos.ctrl.api.app import build_app
from kibotos.ctrl.live.context import CtrlContext
from kibotos.ctrl.live.runtime import Runtime
from kibotos.ctrl.live.services import CtrlServices
from kibotos.ctrl.live.workspace_service import WorkspaceService
from kibotos.ctrl.serve import build_context, build_services, hypercorn_config, open_store
from kibotos.ctrl.store.models import Template
from kibotos.testing.asgi_websocket import InProcessConnector
from kibotos.testing.fake_node import SimNode, open_sim_node
from kibotos.testing.sim_instances import SimInstances

GI = 1 << 30
DIGEST = "sha256:" + "ab" * 32
TEMPLATE = "base"
#: ``instance.create``'s ``template`` of `TEMPLATE`, for a test that commands a
#: simulated node itself.
TEMPLATE_REF = {"name": TEMPLATE, "image_digest": DIGEST,
                "kernel_digest": "sha256:" + "cd" * 32,
                "initramfs_digest": "sha256:" + "ef" * 32}


def add_template(session: Session, name: str = TEMPLATE) -> None:
    now = datetime.now(UTC)
    session.add(Template(name=name, image_digest=DIGEST, image_size=1 << 20,
                         kernel_digest="sha256:" + "cd" * 32,
                         initramfs_digest="sha256:" + "ef" * 32, source=None,
                         created_at=now, updated_at=now, revision=1))


@dataclass
class WsCtrl:
    ctx: CtrlContext
    services: CtrlServices
    url: str
    http: httpx.AsyncClient
    operator: dict[str, str]
    nursery: trio.Nursery
    #: Opens in-memory streams to the session endpoint; None: connect to `url`.
    connector: InProcessConnector | None = None
    nodes: dict[str, SimNode] = field(default_factory=dict)
    sims: dict[str, SimInstances] = field(default_factory=dict)
    creds: dict[str, str] = field(default_factory=dict)
    incarnations: dict[str, int] = field(default_factory=dict)
    _stops: dict[str, tuple[trio.Event, trio.Event]] = field(default_factory=dict)
    _scopes: dict[str, trio.CancelScope] = field(default_factory=dict)

    @property
    def service(self) -> WorkspaceService:
        return self.services.workspaces

    @property
    def runtime(self) -> Runtime:
        """What the services share: the capacity index, the in-flight map."""
        return self.services.runtime

    # ------------------------------------------------------------------ API

    async def call(self, method: str, path: str, *, code: str | None = None,
                   **kwargs: Any) -> Any:
        resp = await self.http.request(method, path, headers=self.operator, **kwargs)
        body = resp.json()
        if code is None:
            assert resp.status_code == 200, body
            return body["result"]
        assert "error" in body, body
        assert body["error"]["code"] == code, body
        return body["error"]

    async def create(self, code: str | None = None, **body: Any) -> Any:
        return await self.call("POST", "/v1/workspaces",
                               json={"template": TEMPLATE, **body}, code=code)

    async def ws(self, workspace_id: str, wait_s: float = 0.0) -> dict[str, Any]:
        return dict(await self.call("GET", f"/v1/workspaces/{workspace_id}",
                                    params={"wait_s": wait_s}))

    async def settled(self, workspace_id: str, timeout: float = 30.0) -> dict[str, Any]:
        with trio.fail_after(timeout):
            while True:
                got = await self.ws(workspace_id, wait_s=5.0)
                if got["state"] in ("AVAILABLE", "STOPPED", "FAILED", "DELETED"):
                    return got

    async def action(self, workspace_id: str, verb: str, code: str | None = None,
                     **body: Any) -> Any:
        return await self.call("POST", f"/v1/workspaces/{workspace_id}/{verb}", json=body,
                               code=code)

    async def node(self, node_id: str) -> dict[str, Any]:
        return dict(await self.call("GET", f"/v1/nodes/{node_id}"))

    # ------------------------------------------------------------------ nodes

    async def connect(self, node_id: str, *, wait_eligible: bool = True,
                      sim: SimInstances | None = None, **kwargs: Any) -> SimNode:
        """Enroll (first time) and connect a simulated node in a task of its own (so
        nodes can come and go in any order); by default wait until placement may use
        it (clock measured in this session)."""
        if node_id not in self.creds:
            self.creds[node_id] = await enroll_node(self.http, self.operator, node_id)
        self.incarnations[node_id] = self.incarnations.get(node_id, 0) + 1
        sim = sim or self.sims.get(node_id) or SimInstances()
        self.sims[node_id] = sim
        incarnation = kwargs.pop("incarnation", self.incarnations[node_id])
        stop, done = trio.Event(), trio.Event()

        async def play(*, task_status: trio.TaskStatus[SimNode]) -> None:
            try:
                async with open_sim_node(self.url, self.creds[node_id], node_id,
                                         incarnation, sim=sim, connect=self.connector,
                                         **kwargs) as node:
                    task_status.started(node)
                    with trio.CancelScope() as scope:
                        self._scopes[node_id] = scope
                        await stop.wait()
            finally:
                done.set()

        node: SimNode = await self.nursery.start(play)
        self._stops[node_id] = (stop, done)
        self.nodes[node_id] = node
        if wait_eligible:
            await self.wait_eligible(node_id)
        return node

    async def disconnect(self, node_id: str, *, wait_dead: bool = True) -> None:
        stop, done = self._stops.pop(node_id)
        self.nodes.pop(node_id, None)
        stop.set()
        await done.wait()
        if not wait_dead:
            return

        async def dead() -> bool:
            return not (await self.node(node_id))["latest_session"]["alive"]

        await wait_until(dead, f"{node_id} session ended")

    async def wait_eligible(self, node_id: str, want: bool = True) -> None:
        async def check() -> bool:
            return bool((await self.node(node_id))["placement"]["eligible"]) is want

        await wait_until(check, f"{node_id} placement eligible is {want}")

    async def close(self) -> None:
        for node_id in list(self._stops):
            await self.disconnect(node_id, wait_dead=False)


@asynccontextmanager
async def open_ws_ctrl(tmp_path: Path, *, policy: str = "binpack", in_process: bool = True,
                       **ctrl: object) -> AsyncIterator[WsCtrl]:
    """ctrl with its Workspace service and an enrolled operator.  In-process by default
    (the API through ``httpx.ASGITransport``, node sessions over in-memory streams): no
    socket, so the test may take the autojump clock.  ``in_process=False`` serves it
    with hypercorn on 127.0.0.1:0, for tests that give its URL to another party (a
    simulated node's transfer client, a rendered config)."""
    config = make_config(tmp_path, session_timeout="3s", reconcile_interval="1h",
                         overcommit_ack_timeout="2s", placement_policy=policy, **ctrl)
    store = await open_store(config)
    await store.write(add_template)
    ctx = build_context(config, store)
    services = build_services(ctx)
    app = build_app(services)
    try:
        async with trio.open_nursery() as nursery:
            connector: InProcessConnector | None = None
            if in_process:
                url = "http://ctrl"
                connector = InProcessConnector(app, nursery)
                transport: httpx.AsyncBaseTransport = httpx.ASGITransport(app=app)
            else:
                binds = await nursery.start(partial(
                    hypercorn_serve, app, hypercorn_config(config.ctrl.listen)))
                url = binds[0]
                transport = httpx.AsyncHTTPTransport()
            await nursery.start(services.run)
            async with httpx.AsyncClient(base_url=url, timeout=60,
                                         transport=transport) as http:
                operator = await enroll_operator(http, store)
                ws_ctrl = WsCtrl(ctx, services, url, http, operator, nursery,
                                 connector=connector)
                try:
                    yield ws_ctrl
                finally:
                    await ws_ctrl.close()
            nursery.cancel_scope.cancel()
    finally:
        store.close()


async def away_with_one_lost_and_one_stray(ctrl: WsCtrl, node_id: str = "node-a"
                                           ) -> tuple[dict[str, Any], dict[str, Any],
                                                      SimInstances]:
    """Two Workspaces on `node_id`, then the node away: while away it lost the second's
    Instance and gained ``inst-stray``, which ctrl has no record of.  Returns the kept
    and the lost Workspace and the node's simulated Instances, to reconnect with."""
    kept = await ctrl.settled((await ctrl.create())["workspace_id"])
    lost = await ctrl.settled((await ctrl.create())["workspace_id"])
    await ctrl.disconnect(node_id)
    sim = ctrl.sims[node_id]
    del sim.instances[lost["instance_id"]]
    stray = await sim.handle("instance.create", {
        "instance_id": "inst-stray", "workspace_id": "ws-stray", "cpu_millis": 100,
        "memory_bytes": 1 << 26, "template": TEMPLATE_REF,
        "layer": {"pool_id": f"{node_id}-local", "ref": "lay-stray",
                  "capacity_bytes": 1 << 26, "epoch": 1, "create": True}})
    assert stray == {"accepted": True}
    return kept, lost, sim


async def events(ctrl: WsCtrl, subject: str) -> list[dict[str, Any]]:
    from sqlalchemy import select

    from kibotos.ctrl.store.models import Event

    def txn(session: Session) -> list[dict[str, Any]]:
        rows = session.scalars(select(Event).where(Event.subject == subject)
                               .order_by(Event.id))
        return [{"kind": e.kind, **(e.detail or {})} for e in rows]

    return await ctrl.ctx.store.run(txn)
