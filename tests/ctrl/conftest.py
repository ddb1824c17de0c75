"""Fixtures of the ctrl tests: a migrated store on SQLite and on a real PostgreSQL server
(the shared ``postgres_url`` fixture of tests/conftest.py starts it), the ASGI app driven
in-process through ``httpx.ASGITransport``, an enrolled operator, and a ctrl with its
session endpoint for the session tests: served by hypercorn on 127.0.0.1 port 0
(``running_ctrl``), or in-process without a socket (``inprocess_ctrl``: the API through
``httpx.ASGITransport``, sessions over in-memory streams,
`kibotos.testing.asgi_websocket`), which can run under the autojump clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from ctrl_helpers import RunningCtrl, enroll_operator, make_config
from hypercorn.trio import serve as hypercorn_serve

from kibotos.config import CtrlConfig
from kibotos.ctrl.api.app import build_app
from kibotos.ctrl.live.context import CtrlContext
from kibotos.ctrl.live.services import CtrlServices
from kibotos.ctrl.serve import (
    build_context,
    build_services,
    hypercorn_config,
    open_store,
    prepare_tls,
)
from kibotos.ctrl.store.db import Store
from kibotos.testing.asgi_websocket import InProcessConnector
from kibotos.tls.local_ctrl import client_tls


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ctrl.db'}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def ctrl_config(tmp_path: Path, db_url: str) -> CtrlConfig:
    return make_config(tmp_path, db_url)


@pytest.fixture
async def store(ctrl_config: CtrlConfig) -> AsyncIterator[Store]:
    s = await open_store(ctrl_config)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def ctx(ctrl_config: CtrlConfig, store: Store) -> CtrlContext:
    return build_context(ctrl_config, store)


@pytest.fixture
def services(ctx: CtrlContext) -> CtrlServices:
    """The context's live services, built once (not running: no test here needs them
    to serve; `ws_helpers.open_ws_ctrl` runs them)."""
    return build_services(ctx)


@pytest.fixture
async def client(services: CtrlServices) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(services))
    async with httpx.AsyncClient(transport=transport, base_url="http://ctrl") as c:
        yield c


@pytest.fixture
async def operator(client: httpx.AsyncClient, store: Store) -> dict[str, str]:
    """Authorization headers of an operator enrolled the way the first one is."""
    return await enroll_operator(client, store)


@pytest.fixture
async def running_ctrl(tmp_path: Path) -> AsyncIterator[RunningCtrl]:
    """A real ctrl app served by hypercorn on 127.0.0.1:0 over HTTPS (a certificate from
    its cluster CA; SQLite, short timeouts) with an enrolled operator; the test can reach
    its context (store, session hub)."""
    config = session_config(tmp_path)
    store = await open_store(config)
    ctx = build_context(config, store)
    app = build_app(build_services(ctx))
    try:
        async with trio.open_nursery() as nursery:
            tls = prepare_tls(config, ctx)
            binds = await nursery.start(partial(
                hypercorn_serve, app,
                hypercorn_config(config.ctrl.listen, tls)))
            ctrl = RunningCtrl(config=config, ctx=ctx, url=binds[0],
                               tls=client_tls(config), app=app)
            async with httpx.AsyncClient(base_url=ctrl.url, timeout=30,
                                         verify=ctrl.tls) as http:
                ctrl.http = http
                ctrl.operator = await enroll_operator(http, store)
                yield ctrl
            nursery.cancel_scope.cancel()
    finally:
        store.close()


def session_config(tmp_path: Path) -> CtrlConfig:
    """SQLite and short timeouts, so the session tests see them pass."""
    return make_config(tmp_path, session_timeout="3s", reconcile_interval="1h",
                       overcommit_ack_timeout="2s")


@pytest.fixture
async def inprocess_ctrl(tmp_path: Path) -> AsyncIterator[RunningCtrl]:
    """`running_ctrl` without a socket: nothing the test waits for is outside trio, so
    it may take the autojump clock."""
    config = session_config(tmp_path)
    store = await open_store(config)
    ctx = build_context(config, store)
    app = build_app(build_services(ctx))
    try:
        async with trio.open_nursery() as nursery:
            ctrl = RunningCtrl(config=config, ctx=ctx, url="http://ctrl",
                               connect=InProcessConnector(app, nursery))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url=ctrl.url, timeout=30) as http:
                ctrl.http = http
                ctrl.operator = await enroll_operator(http, store)
                yield ctrl
            nursery.cancel_scope.cancel()
    finally:
        store.close()
