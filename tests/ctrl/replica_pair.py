"""Two ctrl replicas (`replica_procs`) on one PostgreSQL database, ready for requests:
the base Template stored, an operator enrolled, a client to each replica, and node
credentials on demand; everything stopped when the block ends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from ctrl_helpers import enroll_operator, exchange, result
from replica_procs import Replica, start_replica, stop_all
from ws_helpers import add_template

from kibotos.ctrl.serve import open_store
from kibotos.ctrl.store.db import Store
from kibotos.tls.local_ctrl import client_tls


@dataclass
class ReplicaPair:
    a: Replica
    b: Replica
    store: Store
    tls: Any
    via_a: httpx.AsyncClient
    via_b: httpx.AsyncClient
    operator: dict[str, str]

    async def node_credential(self, node_id: str) -> dict[str, Any]:
        """Enroll `node_id` through replica A: the exchange's answer (credential, ID)."""
        grant = result(await self.via_a.post("/v1/enrollment/grants", headers=self.operator,
                                             json={"kind": "node", "node_id": node_id}))
        issued: dict[str, Any] = await exchange(self.via_a, grant["token"])
        return issued


@asynccontextmanager
async def two_replicas(tmp_path: Path, postgres_url: str, *, session_timeout: str = "15s",
                       timeout: float = 60) -> AsyncIterator[ReplicaPair]:
    a = await start_replica(tmp_path, "ctrl-a", postgres_url, None, session_timeout)
    replicas = [a]
    store = await open_store(a.config)
    try:
        b = await start_replica(tmp_path, "ctrl-b", postgres_url, tmp_path / "ctrl-a",
                                session_timeout)
        replicas.append(b)
        tls = client_tls(a.config)
        await store.write(add_template)
        async with httpx.AsyncClient(base_url=a.url, verify=tls, timeout=timeout) as via_a, \
                httpx.AsyncClient(base_url=b.url, verify=tls, timeout=timeout) as via_b:
            operator = await enroll_operator(via_a, store)
            yield ReplicaPair(a, b, store, tls, via_a, via_b, operator)
    finally:
        store.close()
        await stop_all(replicas)
