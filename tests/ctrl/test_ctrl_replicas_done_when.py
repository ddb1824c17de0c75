"""Issue 14's "Done when": three ctrl replicas as real processes on a real PostgreSQL
server and three simulated nodes, one per replica; a stream of creates, stops and
deletes sent through all replicas, and the lease holder SIGKILLed in the middle of it.

A client that meets a connection failure sends the same command (same command ID) to
the next replica, as `kibo` does with several URLs; a node whose replica died
reconnects to a survivor (the test plays the load balancer).  Afterwards: every command
completed or failed with a clear error, every command ID replayed on every survivor
returns the stored result, no node is over its schedulable amount and no pool over its
capacity, no Workspace was duplicated or lost, every node's session lives on a
survivor, and the lease moved to a survivor (how long it took is printed)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from ctrl_helpers import enroll_operator, exchange, result
from replica_procs import Replica, lease, sessions, start_replica, stop_all
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from ws_helpers import add_template

from kibotos.ctrl.serve import open_store
from kibotos.ctrl.store.db import Store
from kibotos.ctrl.store.models import Allocation, Command, CtrlReplica, Workspace
from kibotos.testing.fake_node import open_sim_node
from kibotos.testing.sim_instances import SimInstances
from kibotos.testing.waiting import wait_until
from kibotos.tls.local_ctrl import client_tls

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

SESSION_TIMEOUT = "6s"
NODES = ("node-a", "node-b", "node-c")
#: Workspaces each client creates, stops and deletes, one after the other.
ROUNDS = 4
#: Room for one Workspace of the default size (1 CPU, 1 GiB) per node, so the three
#: clients' creates contend for the nodes and placement on several replicas is tested.
NODE_RESOURCES = {"cpu_millis": 1500, "memory_bytes": 3 << 29}
#: The lease holder is killed once this many creates have completed.
KILL_AFTER = 4


@dataclass
class Cluster:
    replicas: list[Replica]
    store: Store
    headers: dict[str, str]
    tls: Any
    dead: set[str] = field(default_factory=set)
    #: Every command sent: (method, path, body) → its outcome (a result or an error).
    outcomes: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = field(
        default_factory=dict)
    creates_done: int = 0
    #: The replica struck (killed, or stopped and resumed).
    victim: Replica | None = None
    killed: trio.Event = field(default_factory=trio.Event)

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.name not in self.dead]

    async def send(self, first: int, method: str, path: str,
                   body: dict[str, Any] | None = None) -> httpx.Response:
        """To replica `first`, and on a connection failure to the next live one, the
        same request (same command ID) each time."""
        order = self.replicas[first:] + self.replicas[:first]
        last: Exception | None = None
        for _round in range(3):
            for replica in order:
                if replica.name in self.dead:
                    continue
                try:
                    async with httpx.AsyncClient(base_url=replica.url, verify=self.tls,
                                                 timeout=90) as http:
                        return await http.request(method, path, json=body,
                                                  headers=self.headers)
                except httpx.TransportError as exc:
                    last = exc
            await trio.sleep(1)
        raise AssertionError(f"no replica answered {method} {path}: {last!r}")

    async def command(self, first: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = await self.send(first, "POST", path, body)
        outcome = resp.json()
        # A clear answer: a result, or an error with a code and a message.
        assert "result" in outcome or {"code", "message"} <= set(outcome["error"]), outcome
        self.outcomes[body["command_id"]] = ("POST", path, body, outcome)
        return dict(outcome)

    async def settle(self, first: int, workspace_id: str, states: set[str]) -> str:
        """Until the Workspace is in one of `states`.  An error answer (a replica that
        just resumed and finds its store transaction aborted, say: `unavailable`) is
        "not yet", as a client polling would take it; the deadline still bounds it."""
        async def probe() -> str | None:
            resp = await self.send(first, "GET", f"/v1/workspaces/{workspace_id}?wait_s=5")
            answer = resp.json()
            if "result" not in answer:
                return None
            state = str(answer["result"]["state"])
            return state if state in states else None
        return await wait_until(probe, f"{workspace_id} in {states}", timeout=180)


async def _client(cluster: Cluster, index: int) -> None:
    """Create, stop, delete ROUNDS Workspaces through replica `index` (and the next
    ones when it is gone)."""
    for k in range(ROUNDS):
        created = await cluster.command(index, "/v1/workspaces", {
            "template": "base", "command_id": f"create-{index}-{k}"})
        if "error" in created:
            continue
        ws_id = created["result"]["workspace_id"]
        cluster.creates_done += 1
        await _stop_and_delete(cluster, index, ws_id, f"{index}-{k}")


async def _stop_and_delete(cluster: Cluster, index: int, ws_id: str, tag: str) -> None:
    """Settle, stop when AVAILABLE (a delete takes only a stopped or failed Workspace),
    delete, and wait for DELETED, each command with its own ID (`tag` makes them)."""
    state = await cluster.settle(index, ws_id, {"AVAILABLE", "FAILED"})
    if state == "AVAILABLE":
        await cluster.command(index, f"/v1/workspaces/{ws_id}/stop",
                              {"command_id": f"stop-{tag}"})
        await cluster.settle(index, ws_id, {"STOPPED", "FAILED"})
    await cluster.command(index, f"/v1/workspaces/{ws_id}/delete",
                          {"command_id": f"delete-{tag}"})
    await cluster.settle(index, ws_id, {"DELETED"})


async def _node(cluster: Cluster, node_id: str, credential: str, home: int,
                sim: SimInstances) -> None:
    """Play one node: connected to its home replica, then to a survivor whenever its
    session ends (a load balancer in front of the replicas would do the same)."""
    choice = home
    while True:
        live = cluster.live()
        replica = cluster.replicas[choice % 3]
        if replica.name in cluster.dead:
            replica = live[choice % len(live)]
        try:
            async with open_sim_node(replica.url, credential, node_id, 1, sim=sim,
                                     ssl_context=cluster.tls,
                                     resources=NODE_RESOURCES) as node:
                await node.closed.wait()
        except (OSError, trio.BrokenResourceError, ConnectionError) as exc:
            print(f"{node_id}: connecting to {replica.name} failed: {exc!r}")
        except Exception as exc:  # a refused handshake of a dying replica: try again
            print(f"{node_id}: session on {replica.name} ended: {exc!r}")
        choice += 1
        await trio.sleep(0.5)


async def _replica_ids(store: Store) -> set[str]:
    def read(session: Session) -> set[str]:
        return set(session.scalars(select(CtrlReplica.replica_id)))
    return await store.run(read)


async def _strike(cluster: Cluster, by_replica_id: dict[str, Replica], how: str,
                  measured: dict[str, float]) -> None:
    """Once the stream is under way, SIGKILL the lease holder, or SIGSTOP it until
    another replica took the lease over and declared it gone, then SIGCONT it."""
    await wait_until(lambda: cluster.creates_done >= KILL_AFTER, "creates under way",
                     timeout=300)
    holder_id, token = await lease(cluster.store)
    victim = cluster.victim = by_replica_id[str(holder_id)]
    cluster.dead.add(victim.name)
    victim.proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    struck_at = trio.current_time()
    measured["token"] = token
    others = {k for k, v in by_replica_id.items() if v is not victim}

    async def moved() -> bool:
        holder, new_token = await lease(cluster.store)
        return holder in others and new_token > token
    await wait_until(moved, "another replica took the lease over", timeout=120)
    measured["lease_moved_s"] = trio.current_time() - struck_at
    if how == "stop":
        async def declared_gone() -> bool:
            return str(holder_id) not in await _replica_ids(cluster.store)
        await wait_until(declared_gone, "the stopped replica declared gone", timeout=120)
        measured["token_after_takeover"] = (await lease(cluster.store))[1]
        victim.proc.send_signal(signal.SIGCONT)

        async def back() -> bool:
            return str(holder_id) in await _replica_ids(cluster.store)
        await wait_until(back, "the resumed replica registered again", timeout=120)
        cluster.dead.discard(victim.name)  # it serves again, as a non-holder
        measured["resumed_log_offset"] = len(victim.log_text())
    cluster.killed.set()


@pytest.mark.parametrize("how", ["kill", "stop"])
async def test_the_lease_holder_struck_in_a_stream_of_creates_stops_and_deletes(
        tmp_path: Path, postgres_url: str, how: str) -> None:
    replicas: list[Replica] = []
    store = None
    try:
        replicas.append(await start_replica(tmp_path, "ctrl-a", postgres_url, None,
                                            SESSION_TIMEOUT))
        for name in ("ctrl-b", "ctrl-c"):
            replicas.append(await start_replica(tmp_path, name, postgres_url,
                                                tmp_path / "ctrl-a", SESSION_TIMEOUT))
        store = await open_store(replicas[0].config)
        tls = client_tls(replicas[0].config)
        await store.write(add_template)
        async with httpx.AsyncClient(base_url=replicas[0].url, verify=tls) as http:
            operator = await enroll_operator(http, store)
            creds = {}
            for node_id in NODES:
                grant = result(await http.post("/v1/enrollment/grants", headers=operator,
                                               json={"kind": "node", "node_id": node_id}))
                creds[node_id] = (await exchange(http, grant["token"]))["credential"]
        cluster = Cluster(replicas, store, operator, tls)
        measured: dict[str, float] = {}
        async with trio.open_nursery() as nodes:
            for i, node_id in enumerate(NODES):
                nodes.start_soon(_node, cluster, node_id, creds[node_id], i, SimInstances())

            async def all_connected() -> dict[str, dict[str, Any]] | None:
                now = await sessions(store)
                return now if all(now.get(n, {}).get("alive") for n in NODES) else None
            placed = await wait_until(all_connected, "every node connected", timeout=60)
            by_replica_id = {placed[n]["replica"]: replicas[i] for i, n in enumerate(NODES)}
            assert len(by_replica_id) == 3

            async with trio.open_nursery() as stream:
                stream.start_soon(_strike, cluster, by_replica_id, how, measured)
                for i in range(3):
                    stream.start_soon(_client, cluster, i)
            assert cluster.killed.is_set()
            survivors = cluster.live()
            survivor_ids = {k for k, v in by_replica_id.items() if v in survivors}

            # Every node's session moved to (or stayed on) a survivor.
            async def on_survivors() -> bool:
                now = await sessions(store)
                return all(now[n]["alive"] and now[n]["replica"] in survivor_ids
                           for n in NODES)
            await wait_until(on_survivors, "every session on a survivor", timeout=120)

            await _check_replays(cluster, survivors)
            await _check_no_duplicate_or_lost(cluster)
            await _check_within_capacity(cluster, survivors)
            holder, token = await lease(store)
            assert holder in survivor_ids
            assert token > measured["token"]
            assert cluster.victim is not None
            assert by_replica_id[str(holder)] is not cluster.victim
            if how == "stop":
                # The resumed replica never acted as holder again: the lease kept the
                # token of the takeover, and its log shows no grant after it resumed.
                assert token == measured["token_after_takeover"]
                tail = cluster.victim.log_text()[int(measured["resumed_log_offset"]):]
                assert "holds the lease" not in tail
            nodes.cancel_scope.cancel()
        print(f"{how}: lease moved {measured['lease_moved_s']:.2f} s after the signal "
              f"(session timeout {SESSION_TIMEOUT}); {len(cluster.outcomes)} commands, "
              f"{sum('error' in o[3] for o in cluster.outcomes.values())} failed clearly")
    finally:
        if store is not None:
            store.close()
        await stop_all(replicas)


async def _check_replays(cluster: Cluster, survivors: list[Replica]) -> None:
    """The same command ID on any survivor: the stored result (or the stored error).

    A failure is not journaled, so the replay of a failed command is a fresh try; for
    a create that failed for want of room (room the deletes have since freed) it makes
    a Workspace.  That Workspace is then the command's journaled result on every other
    survivor, counted as created, and deleted like the others."""
    for command_id, (_method, path, body, outcome) in list(cluster.outcomes.items()):
        fresh: dict[str, Any] | None = None
        for replica in survivors:
            async with httpx.AsyncClient(base_url=replica.url, verify=cluster.tls,
                                         timeout=90) as http:
                replay = (await http.post(path, json=body, headers=cluster.headers)).json()
            if "result" in outcome:
                assert replay == outcome, (command_id, replica.name)
            elif fresh is not None:  # the fresh try's result is journaled now
                assert replay == fresh, (command_id, replica.name)
            elif "result" in replay:
                fresh = replay
            else:
                assert {"code", "message"} <= set(replay["error"]), replay
        if fresh is not None and path == "/v1/workspaces":
            cluster.outcomes[command_id] = ("POST", path, body, fresh)
            ws_id = fresh["result"]["workspace_id"]
            await _stop_and_delete(cluster, 0, ws_id, f"after-replay-{command_id}")


async def _check_no_duplicate_or_lost(cluster: Cluster) -> None:
    created = {o[3]["result"]["workspace_id"] for o in cluster.outcomes.values()
               if o[1] == "/v1/workspaces" and "result" in o[3]}

    def read(session: Session) -> tuple[set[str], int, dict[str, str]]:
        ids = set(session.scalars(select(Workspace.workspace_id)))
        states = session.scalar(select(func.count()).select_from(Workspace)
                                .where(Workspace.state != "DELETED"))
        # Which journaled command recorded each Workspace: names the command behind
        # a Workspace the clients never saw.
        journaled = {str((c.result or {}).get("workspace_id")): c.command_id
                     for c in session.scalars(select(Command).where(
                         Command.operation == "workspace.create"))}
        return ids, int(states or 0), journaled
    stored, not_deleted, journaled = await cluster.store.run(read)
    failed = {c: o[3] for c, o in cluster.outcomes.items()
              if o[1] == "/v1/workspaces" and "error" in o[3]}
    # every create once, none lost, none made twice
    assert stored == created, (
        {w: journaled.get(w) for w in stored - created}, created - stored, failed)
    assert not_deleted == 0   # and every one was deleted in the end


async def _check_within_capacity(cluster: Cluster, survivors: list[Replica]) -> None:
    """At no moment did a node's Allocations exceed its schedulable amount: replayed
    from the Allocation rows' creation and release times."""
    async with httpx.AsyncClient(base_url=survivors[0].url, verify=cluster.tls) as http:
        nodes = result(await http.get("/v1/nodes", headers=cluster.headers))["nodes"]
    schedulable = {n["node_id"]: n["schedulable"] for n in nodes}

    def read(session: Session) -> list[Allocation]:
        return list(session.scalars(select(Allocation)))
    allocations = await cluster.store.run(read)
    assert allocations  # the stream placed something
    for a in allocations:
        at = a.created_at
        holding = [b for b in allocations if b.node_id == a.node_id and b.created_at <= at
                   and (b.released_at is None or b.released_at > at)]
        room = schedulable[a.node_id]
        assert sum(b.cpu_millis for b in holding) <= room["cpu_millis"], a.instance_id
        assert sum(b.memory_bytes for b in holding) <= room["memory_bytes"], a.instance_id
