"""Two ctrl replicas as real processes on a real PostgreSQL server, a simulated node on
each: the lease holder SIGKILLed (the lease and its node's session move to the survivor,
nothing alive is ended), and the holder SIGSTOPped and resumed (it never acts as holder
again after the other took over; it closes the sessions it was declared gone with, and
its node reconnects)."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from ctrl_helpers import enroll_operator, exchange, result
from replica_procs import Replica, lease, sessions, start_replica, stop_all
from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.ctrl.serve import open_store
from kibotos.ctrl.store.db import Store
from kibotos.ctrl.store.models import CtrlReplica
from kibotos.testing.fake_node import SimNode, open_sim_node
from kibotos.testing.waiting import wait_until
from kibotos.tls.local_ctrl import client_tls

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

#: Short, so the failovers take seconds; the lease lives two thirds of it.
SESSION_TIMEOUT = "6s"


async def _two_replicas(tmp_path: Path, postgres_url: str) -> list[Replica]:
    first = await start_replica(tmp_path, "ctrl-a", postgres_url, None, SESSION_TIMEOUT)
    try:
        second = await start_replica(tmp_path, "ctrl-b", postgres_url, tmp_path / "ctrl-a",
                                     SESSION_TIMEOUT)
    except BaseException:
        await stop_all([first])
        raise
    return [first, second]


async def _node_credentials(replica: Replica, store: Store) -> dict[str, str]:
    async with httpx.AsyncClient(base_url=replica.url,
                                 verify=client_tls(replica.config)) as http:
        operator = await enroll_operator(http, store)
        creds = {}
        for node_id in ("node-a", "node-b"):
            grant = result(await http.post("/v1/enrollment/grants", headers=operator,
                                           json={"kind": "node", "node_id": node_id}))
            creds[node_id] = (await exchange(http, grant["token"]))["credential"]
    return creds


async def _replica_ids(store: Store) -> set[str]:
    def read(session: Session) -> set[str]:
        return set(session.scalars(select(CtrlReplica.replica_id)))
    return await store.run(read)


async def _holder_among(store: Store, ids: dict[str, Replica]) -> tuple[str, int]:
    async def probe() -> tuple[str, int] | None:
        holder, token = await lease(store)
        return (holder, token) if holder in ids else None
    return await wait_until(probe, "one replica holds the lease", timeout=60)


@asynccontextmanager
async def _a_node_on_each(replicas: list[Replica], creds: dict[str, str]
                          ) -> AsyncIterator[dict[str, SimNode]]:
    """node-a's session on the first replica, node-b's on the second."""
    tls = client_tls(replicas[0].config)
    async with open_sim_node(replicas[0].url, creds["node-a"], "node-a", 1,
                             ssl_context=tls) as on_a, \
            open_sim_node(replicas[1].url, creds["node-b"], "node-b", 1,
                          ssl_context=tls) as on_b:
        yield {"node-a": on_a, "node-b": on_b}


@dataclass(frozen=True)
class Struck:
    """The lease holder the test strikes, its node, and the other replica and node."""

    holder_id: str
    token: int
    holder: Replica
    holder_node: str
    other_id: str
    other: Replica
    other_node: str


async def _struck(store: Store, replicas: list[Replica],
                  before: dict[str, dict[str, Any]]) -> Struck:
    by_id = {str(before["node-a"]["replica"]): replicas[0],
             str(before["node-b"]["replica"]): replicas[1]}
    holder_id, token = await _holder_among(store, by_id)
    (other_id, other), = ((k, v) for k, v in by_id.items() if k != holder_id)
    holder_node, other_node = (("node-a", "node-b") if by_id[holder_id] is replicas[0]
                               else ("node-b", "node-a"))
    return Struck(holder_id, token, by_id[holder_id], holder_node, other_id, other,
                  other_node)


async def test_the_lease_and_the_sessions_move_when_the_holder_is_killed(
        tmp_path: Path, postgres_url: str) -> None:
    replicas = await _two_replicas(tmp_path, postgres_url)
    store = await open_store(replicas[0].config)
    try:
        creds = await _node_credentials(replicas[0], store)
        async with _a_node_on_each(replicas, creds) as sims:
            assert sims["node-a"].welcomed
            assert sims["node-b"].welcomed
            before = await sessions(store)
            assert before["node-a"]["alive"]
            assert before["node-b"]["alive"]
            # Each session is recorded under its own replica.
            assert before["node-a"]["replica"] != before["node-b"]["replica"]
            struck = await _struck(store, replicas, before)
            token, victim, victim_node = struck.token, struck.holder, struck.holder_node
            survivor_id, survivor, survivor_node = (struck.other_id, struck.other,
                                                    struck.other_node)
            victim_sim = sims[victim_node]

            victim.proc.send_signal(signal.SIGKILL)
            killed_at = trio.current_time()
            with trio.fail_after(30):
                await victim_sim.closed.wait()

            async def moved() -> bool:
                return await lease(store) == (survivor_id, token + 1)
            await wait_until(moved, "the survivor took the lease over", timeout=60)
            took = trio.current_time() - killed_at

            async def victim_session_ended() -> bool:
                return not (await sessions(store))[victim_node]["alive"]
            await wait_until(victim_session_ended, "the dead replica's session ended",
                             timeout=60)
            after = await sessions(store)
            # The survivor's node was never marked ended.
            assert after[survivor_node] == before[survivor_node]
            assert await _replica_ids(store) == {survivor_id}
        # The node of the dead replica reconnects to the survivor (the test plays the
        # load balancer in front of the replicas).
        async with open_sim_node(survivor.url, creds[victim_node], victim_node, 1,
                                 ssl_context=client_tls(replicas[0].config)) as again:
            assert again.welcomed
            now = await sessions(store)
            assert now[victim_node]["alive"]
            assert now[victim_node]["replica"] == survivor_id
        print(f"lease moved {took:.2f} s after the SIGKILL (session timeout "
              f"{SESSION_TIMEOUT})")
    finally:
        store.close()
        await stop_all(replicas)


async def test_a_stopped_holder_never_acts_after_another_took_over(
        tmp_path: Path, postgres_url: str) -> None:
    replicas = await _two_replicas(tmp_path, postgres_url)
    store = await open_store(replicas[0].config)
    try:
        creds = await _node_credentials(replicas[0], store)
        async with _a_node_on_each(replicas, creds) as sims:
            before = await sessions(store)
            struck = await _struck(store, replicas, before)
            holder_id, token, stopped = struck.holder_id, struck.token, struck.holder
            other_id, stopped_node, other_node = (struck.other_id, struck.holder_node,
                                                  struck.other_node)
            stopped_sim = sims[stopped_node]

            stopped.proc.send_signal(signal.SIGSTOP)
            try:
                async def taken() -> bool:
                    return await lease(store) == (other_id, token + 1)
                await wait_until(taken, "the other replica took the lease over", timeout=60)

                async def declared_gone() -> bool:
                    return holder_id not in await _replica_ids(store)
                await wait_until(declared_gone, "the stopped replica declared gone",
                                 timeout=60)
                assert not (await sessions(store))[stopped_node]["alive"]
            finally:
                stopped.proc.send_signal(signal.SIGCONT)
            # Resumed, it learns it was declared gone, closes the session whose row was
            # ended, so its node reconnects (or its session's own timeout, which the
            # stop outlasted, closes it first), and registers again, as a non-holder.
            with trio.fail_after(60):
                await stopped_sim.closed.wait()

            async def back() -> bool:
                return holder_id in await _replica_ids(store)
            await wait_until(back, "the resumed replica registered again", timeout=60)
            await _rounds_pass(store, holder_id, 2)
            assert await lease(store) == (other_id, token + 1)
            assert (await sessions(store))[other_node] == before[other_node]
            assert "was declared gone" in stopped.log_text()
    finally:
        store.close()
        await stop_all(replicas)


async def _rounds_pass(store: Store, replica_id: str, count: int) -> None:
    """Until `replica_id` renewed its heartbeat `count` more times: each round renews
    it before trying the lease, so `count - 1` lease attempts have completed."""
    def beat(session: Session) -> object:
        row = session.get(CtrlReplica, replica_id)
        return None if row is None else row.heartbeat_at
    for _ in range(count):
        seen = await store.run(beat)

        async def renewed(seen: object = seen) -> bool:
            return await store.run(beat) != seen
        await wait_until(renewed, f"replica {replica_id} renewed its heartbeat", timeout=60)
