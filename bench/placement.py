"""Placements per second and create latency: 10,000 Workspaces through the real HTTP API
across 1,000 simulated nodes, on SQLite.

Three processes, as in production each part is its own: ctrl (``kibotos ctrl serve``,
optionally under cProfile), the nodes (1,000 control sessions of
`kibotos.testing.fake_node`, answering ``instance.create`` and "booting" at once, in a
process of their own), and this one, the load: ``--concurrency`` callers each sending
``POST /v1/workspaces`` one after another over keep-alive connections.  A create
returns once a node accepted it and ctrl recorded it, so each is one whole placement.

    .venv/bin/python bench/placement.py [--nodes 1000] [--creates 10000]
        [--concurrency 64] [--policy binpack] [--profile ctrl.prof]
        [--group-max N] [--switch-interval S]
        [--store sqlite,postgresql] [--replicas 1,2,3]

``--store`` and ``--replicas`` take comma lists and measure every combination, each on
a fresh cluster (`placement_cluster.py`): PostgreSQL is a server of its own under the
run's directory (fsync on), replicas share it and an artifact directory, replica N gets
copies of replica 1's shared keys (docs/replicas.md); the callers and the node sessions
are spread over the replicas (i mod N), so commands for a node on another replica go
through ctrl's relay.  Several replicas need PostgreSQL (SQLite x2 is skipped).  The end
is one table: placements/s, p50/p99 latency, ctrl CPU per placement summed over every
replica, the PostgreSQL server's CPU apart, each beside the first combination's.

At the end it checks the outcome through the API: every Workspace recorded once, every
node within its schedulable CPU and memory, and how many reached AVAILABLE.  It prints
the CPU each process spent per placement; ``--profile`` adds ctrl's cProfile (CPU time,
`time.thread_time`, so waiting for the GIL is not counted) of the trio thread, a
profile of the store's worker threads (``.threads``) and the CPU of each transaction
function by kind, with the worker-thread calls and how many functions each carried
(``.txns``).  ``--group-max 1`` turns the store's group commit off (every write its
own transaction, as before it), for comparison at the same load.  Target (issue 3):
>= 1,500 placements/s.

Measured on the 2-core test machine, shared with other test runs (load average 3-7,
given with each figure), 200 nodes, 2,000 creates, binpack, concurrency 64; every
Workspace AVAILABLE, no node over its schedulable amount:

* at the start of this round the run did not finish: creates timed out after 120 s.
  The pool-capacity pre-check added with storage pools (`pool_capacity.snapshot`,
  read before each placement) summed each pool with queries of its own, and every
  node has its own default pool: ~170 ms of store work per create at 20 nodes, growing
  with nodes x Workspaces.  Three grouped queries now (`volume_pools.reserved_by_pool`).
* then, without group commit (``--group-max 1``): 46/s at load 3.5 and 43/s at 4.5
  (15.1 ms of ctrl CPU per placement both), 37/s at 5.5 (16.4 ms), 22/s at 7.3
  (19.7 ms); p50 latency 1.4-2.1 s (queueing behind 64 callers);
* with group commit (the default): 75/s and 56/s at load 3.1 (12.3 and 14.5 ms), 58/s
  at 4.6 (12.7 ms), 41-43/s at 5.6 (12.7-13.9 ms), 32/s at 7.1 (14.5 ms); p50 0.8-1.9 s.
  About a sixth less ctrl CPU per placement and a quarter to a third more placements
  per second at the same load.  A group carries ~15 writes on average under this load
  (the node reports, the RUNNING frames and the create records of concurrent
  placements): one worker-thread hop and one commit for all of them.
  A shorter GIL switch interval (``--switch-interval 0.0005``) changed nothing
  measurable (43/s against 41/s at load 5.6).  Two runs at load ~7 (one profiled) ended
  early, the server closing connections while nodes enrolled; not reproduced in six
  runs since, the cause not found (the bench now prints ctrl.log's tail when a run
  fails).

The figures above were taken with SQLite's ``synchronous=NORMAL``; the store now runs
``FULL`` (issue 16: an acknowledged write must survive power loss), so every commit
waits for its fsync.  What that costs a commit, bench/store_sync.py on this machine's
ext4 disk at load 5-6: 215 against 2,221 commits/s of one write (0.10 of the rate),
179 against 417 commits/s of 15 writes (0.43), i.e. ~2,700 writes/s when grouped as
placement load groups them.  That is far above the 32-75 placements/s above, which ctrl
CPU bounds (12-15 ms each), so placements/s should change little; a full placement run
under FULL was not taken in that round.

The earlier figure, 1,000 nodes and 10,000 creates before storage pools: 63/s at load
4, 85/s at load 2, 10.5-11.5 ms of ctrl CPU per placement.

ctrl is CPU-bound on one core (the GIL), and on this machine gets about half of it.
Where its CPU goes now (the CPU profile of the run above: store worker threads ~57%,
the trio thread ~43%):

* the store, by transaction function (share of the worker threads' CPU): the create's
  record with its journal entry 29% (of which the pool-capacity check in the same
  transaction, `pool_capacity.check_room`, 12%: an unindexed sum over the Workspaces
  of the pool plus the Volume and operation reads); the capacity snapshot before
  placing 19% (a grouped sum over all Workspaces: grows with their number); the
  node's two reports per create 12% (`session_store.store_report`, the node row read
  and written, as the contract's "ctrl stores it and bumps registration_version"
  says; the second report, after RUNNING, changes only the report time); the RUNNING
  frame 12% (Instance and Workspace rows, the transition's event); the journal
  look-up 3%; session starts, clock and usage ~10%; sessions, flushes and commits
  the rest.  Most of it is SQLAlchemy's per-statement work (ORM ``get``, autoflush,
  unit of work), not SQLite: the create path runs about 30 statements;
* the trio thread: HTTP (hypercorn's h11 and the starlette app with pydantic) ~40%,
  the WebSocket session frames (command, result, two ``instance_state``, two reports,
  pings) ~30%, trio's scheduling, sockets and worker-thread hand-offs the rest;
  placement itself (admission and ranking from the in-memory index) is well under
  0.1 ms.

Issue 14's round (200 nodes, 2,000 creates, binpack, concurrency 64, SQLite FULL, load
0.6-1.9, unprofiled): the run took 23.1 ms of ctrl CPU per placement at 44/s at its
start (more than the figures above: replicas, the relay and FULL came since).  The
pool-capacity reads were the largest cause: each create summed every pool before the
node was asked, and its own pool again in the create's transaction, through four
statements on unindexed columns.  Now a room read is one statement built once, through
an index on the Workspaces' layer pool (migration 0011), for the candidate's pool only;
the journal entry and the pool row are read as plain rows; the second node report of a
create (same figures) is not written again within 10 s; the Volume and network checks
are one transaction.  After: 69/s at 12.3 ms (x0.53 of the CPU, x1.57 the rate, same
load).  The store threads are now about half of ctrl's CPU: SQLAlchemy's per-statement
work (~0.2 ms a statement, ~15 statements a create: the five row INSERTs, the RUNNING
frame's Instance and Workspace reads and writes, the journal, the report) and the
worker-thread hops (6 a create); the other half is the trio thread (HTTP through
hypercorn and starlette, ~6 WebSocket frames a create, trio's scheduling).

The store/replica matrix, small (30 nodes, 300 creates, load 0.3-2 for the first two),
as first measured: SQLite x1 73/s at 13.2 ms of ctrl CPU; PostgreSQL x1 26/s at 32.6 ms
of ctrl CPU plus 14.0 ms of the server's; PostgreSQL x2 3/s at 407 ms of ctrl CPU for
both replicas and 280 ms of the server's, load average 27: two replicas collapsed.  The
profile of x2 named it: 5,460 look-ups of a relayed create's record in one 90 s run.
Each replica learned of the other's Allocations only at its minute resync, so under
load both chose the same node, the later one's locked re-check in the store refused
it, and the Instance the node had accepted was destroyed again, while the replica
holding the node's session polled for a record that would never come, 5 times a second
for 35 s.  Three fixes (docs/replicas.md, "Placement"): every committed Allocation is
announced on a notification channel with its snapshot in the payload and applied to
the other replicas' indexes at once (`kibotos.ctrl.store.allocation_notes`); each
replica places on the nodes whose sessions it holds first, so most creates need no
relay; and the relay's listener returns at the first notification (it collected for
a whole second before, delaying every hand-over by half of that on average), the
holder of a relayed create waiting on the Allocation notice instead of polling.

After, unprofiled, every check passed in every combination (each Workspace once and
AVAILABLE, no node over its amount):

    30 nodes, 300 creates, load 2-4      placed/s  ctrl CPU/placement  PostgreSQL CPU
    sqlite x1                                122         7.7 ms               -
    postgresql x1                             49        18.3 ms            8.7 ms
    postgresql x2                             76        15.8 ms            6.7 ms
    postgresql x3                             76        16.0 ms            7.4 ms

    200 nodes, 2,000 creates, load 2-16  placed/s  ctrl CPU/placement  PostgreSQL CPU
    sqlite x1                                118         8.1 ms               -
    postgresql x1                             44        20.1 ms           10.4 ms
    postgresql x2                             62        19.0 ms            8.9 ms
    postgresql x3                             60        20.8 ms            8.3 ms

(ctrl CPU summed over the replicas.)  Then the in-store node check of each placement
(`verify_node`, PostgreSQL only) read its rows through plain statements instead of ORM
loads; the same 200-node matrix at load 0.5-2:

    200 nodes, 2,000 creates             placed/s  ctrl CPU/placement  PostgreSQL CPU
    sqlite x1                                119         7.8 ms               -
    postgresql x1                             52        17.5 ms            9.0 ms
    postgresql x2                             73        16.2 ms            7.9 ms
    postgresql x3                             69        18.1 ms            7.6 ms

Two replicas place 1.4-1.55x what one does; a
third adds nothing here because the two cores are full: ctrl's and PostgreSQL's CPU
together are ~28 ms a placement, ~70/s for two cores.  The CPU per placement stays
what one replica spends, so on more cores the rate should grow with the replicas until
PostgreSQL's own CPU (8-10 ms a placement, ~100/s a core) is the limit.  The next
bottleneck on PostgreSQL is the per-transaction cost: ~5.5 transactions a create (the
journal look-up, the pool's room, the create's record, the RUNNING frame, a report),
each a connection check-out with its pre-ping, BEGIN, the statements and COMMIT, every
one a round trip through psycopg and SQLAlchemy (~0.3 ms of ctrl CPU each); the create's
record alone (`Journal._run`: the locked node re-check, the pool's, eight INSERTs) is
about half of the store's CPU.  Fewer round trips (the reads before placement in one
transaction, the INSERTs in one statement, psycopg's pipeline mode) would come first.
(An earlier run of this matrix lost its connections mid-run, "Server disconnected
without sending a response": hypercorn closed idle keep-alive connections after 5 s,
as httpx does, so a request could meet a connection being closed; ctrl now keeps them
75 s.)

Reaching 1,500/s (0.6 ms per placement) still needs a different store path rather than
tuning: the pool reservations kept as running totals (or an index on the Workspaces'
pool) instead of summed per create, Core SQL instead of the ORM on the report and
frame paths, node reports folded in memory, and more than one process; none of that
changes the placement rules tested here.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio
from benchlib import enroll_node, operator_credential, percentile, spawn_ctrl
from placement_cluster import CtrlCluster, Spawned

HERE = Path(__file__).resolve()


# ------------------------------------------------------------------------ ctrl


def start_ctrl(workdir: Path, policy: str, profile: str | None, group_max: int | None,
               switch_interval: float | None, database_url: str = "",
               artifact_dir: Path | None = None) -> tuple[subprocess.Popen[bytes], str, Path]:
    argv = [sys.executable, str(HERE), "--role", "ctrl"]
    if profile:
        argv += ["--profile", profile]
    if group_max is not None:
        argv += ["--group-max", str(group_max)]
    if switch_interval is not None:
        argv += ["--switch-interval", str(switch_interval)]
    store = ""
    if database_url:  # replicas share the store and the artifact directory
        store = f'database_url = "{database_url}"\nartifact_dir = "{artifact_dir}"\n'
    config = (f'[ctrl]\nlisten = "127.0.0.1:0"\nstate_dir = "{workdir / "state"}"\n'
              f'reconcile_interval = "60s"\nplacement_policy = "{policy}"\n{store}'
              '[testing]\npool_capacity = "1P"\n'
              # Placement is measured, not TLS: plain HTTP, which loopback allows.
              '[tls]\nenabled = false\n')
    return spawn_ctrl(workdir, config, argv)


def run_ctrl(config_path: str, profile: str | None, group_max: int | None,
             switch_interval: float | None) -> None:
    """The ctrl process: `serve_ctrl`, under cProfile when asked (the trio thread; the
    SQLite work in worker threads shows as time the loop waits for them)."""
    from kibotos import config as config_mod
    from kibotos.ctrl.serve import serve_ctrl
    from kibotos.ctrl.store.db import Store

    if group_max is not None:  # 1: every write its own transaction, as before groups
        Store.MAX_GROUP = group_max
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    cfg = config_mod.load(config_mod.CtrlConfig, config_path)
    if not profile:
        trio.run(serve_ctrl, cfg)
        return
    import cProfile
    from functools import partial

    prof = cProfile.Profile(time.thread_time)  # CPU time, not wall: GIL waits excluded
    # The store's transactions run in worker threads, which cProfile does not see:
    # profile each thread call, and time each transaction function by what it runs
    # (`Store.apply`: inside its transaction, without the session set-up and commit,
    # which show in the per-call totals instead).
    fn_time: dict[str, list[float]] = {}
    calls: dict[str, list[tuple[int, float]]] = {}

    import pstats
    import threading

    stats_lock = threading.Lock()
    thread_stats: list[pstats.Stats] = []
    original_apply = Store.apply

    def timed_apply(self: Store, fn: Any, session: Any) -> Any:
        inner = fn.func if isinstance(fn, partial) else fn
        name = getattr(inner, "__qualname__", repr(inner))
        t0 = time.thread_time()
        try:
            return original_apply(self, fn, session)
        finally:
            fn_time.setdefault(name, []).append(time.thread_time() - t0)

    def profiled(kind: str, original: Any) -> Any:
        def wrapper(self: Store, arg: Any) -> Any:
            local = cProfile.Profile(time.thread_time)
            t0 = time.thread_time()
            local.enable()
            try:
                return original(self, arg)
            finally:
                local.disable()
                size = len(arg) if isinstance(arg, list) else 1
                calls.setdefault(kind, []).append((size, time.thread_time() - t0))
                with stats_lock:
                    if thread_stats:
                        thread_stats[0].add(local)
                    else:
                        thread_stats.append(pstats.Stats(local))
        return wrapper

    Store.apply = timed_apply  # type: ignore[method-assign]
    Store.run_sync = profiled("transaction", Store.run_sync)  # type: ignore[method-assign]
    Store.run_group_sync = profiled(  # type: ignore[method-assign]
        "write group", Store.run_group_sync)

    def dump(*_: Any) -> None:
        prof.disable()
        prof.dump_stats(profile)
        if thread_stats:
            thread_stats[0].dump_stats(profile + ".threads")
        with open(profile + ".txns", "w") as f:
            for name, times in sorted(fn_time.items(), key=lambda kv: -sum(kv[1])):
                mean = 1000 * sum(times) / len(times)
                f.write(f"{sum(times):8.2f}s {len(times):7d} x {mean:6.2f} ms  {name}\n")
            for kind, made in calls.items():
                total = sum(t for _, t in made)
                items = sum(n for n, _ in made)
                f.write(f"{total:8.2f}s {len(made):7d} x {1000 * total / len(made):6.2f} ms  "
                        f"worker-thread call: {kind} ({items} functions, "
                        f"{items / len(made):.1f} per call)\n")
        os._exit(0)

    signal.signal(signal.SIGUSR1, dump)
    prof.enable()
    trio.run(serve_ctrl, cfg)


async def setup(http: httpx.AsyncClient, nodes: int) -> list[tuple[str, str]]:
    """A Template (three small blobs) and `nodes` node identities, all through the API."""
    digests = {}
    # The smallest blobs ctrl takes for each: an ext4 superblock magic, an ELF magic.
    blobs = {"image": bytes(1080) + b"\x53\xef" + bytes(62), "kernel": b"\x7fELF" + bytes(60),
             "initramfs": b"bench initramfs"}
    for kind, blob in blobs.items():
        hexd = hashlib.sha256(blob).hexdigest()
        (await http.put(f"/v1/artifacts/sha256/{hexd}", content=blob)).raise_for_status()
        digests[f"{kind}_digest"] = f"sha256:{hexd}"
    (await http.put("/v1/templates/bench", json=digests)).raise_for_status()
    creds: list[tuple[str, str]] = []
    limit = trio.CapacityLimiter(16)

    async def enroll(node_id: str) -> None:
        async with limit:
            creds.append((node_id, await enroll_node(http, node_id)))

    async with trio.open_nursery() as nursery:
        for i in range(nodes):
            nursery.start_soon(enroll, f"node-{i:04d}")
    return sorted(creds)


# ------------------------------------------------------------------------ nodes


async def hold_sessions(urls: list[str], creds_file: str) -> None:
    """The node process: one simulated session per node until killed, node i on
    replica i mod N."""
    from kibotos.testing.fake_node import open_sim_node
    from kibotos.testing.sim_instances import SimInstances

    creds = json.loads(await trio.Path(creds_file).read_text())
    connected = 0

    async def one(url: str, node_id: str, credential: str) -> None:
        nonlocal connected
        async with open_sim_node(url, credential, node_id, 1, ping_interval=5.0,
                                 sim=SimInstances()) as node:
            assert node.welcomed, node.first
            connected += 1
            if connected == len(creds):
                print("ready", flush=True)
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        for i, (node_id, credential) in enumerate(creds):
            nursery.start_soon(one, urls[i % len(urls)], node_id, credential)
            await trio.sleep(0.002)


async def wait_eligible(http: httpx.AsyncClient, count: int) -> None:
    with trio.fail_after(600):
        while True:
            eligible, token = 0, None
            while True:
                page = (await http.get("/v1/nodes", params={"page_size": 500,
                                                            "page_token": token})).json()
                eligible += sum(n["placement"]["eligible"] for n in page["result"]["nodes"])
                token = page["result"]["next_page_token"]
                if not token:
                    break
            if eligible == count:
                return
            await trio.sleep(0.5)


# ------------------------------------------------------------------------ load


async def load(clients: list[httpx.AsyncClient], creates: int, concurrency: int,
               body: dict[str, Any], phase: str) -> tuple[float, list[float], dict[str, int]]:
    """`concurrency` callers, caller i sending through replica i mod N."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    counter = iter(range(creates))

    async def caller(http: httpx.AsyncClient) -> None:
        for i in counter:
            t0 = time.perf_counter()
            resp = await http.post("/v1/workspaces", json={**body, "command_id": f"{phase}-{i}"})
            latencies.append(time.perf_counter() - t0)
            if resp.status_code != 200:
                code = resp.json()["error"]["code"]
                errors[code] = errors.get(code, 0) + 1

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for n in range(concurrency):
            nursery.start_soon(caller, clients[n % len(clients)])
    return time.perf_counter() - t0, latencies, errors


async def verify(http: httpx.AsyncClient, expected: int) -> dict[str, int]:
    states: dict[str, int] = {}
    token = None
    while True:
        page = (await http.get("/v1/workspaces", params={"page_size": 500,
                                                         "page_token": token})).json()
        for ws in page["result"]["workspaces"]:
            states[ws["state"]] = states.get(ws["state"], 0) + 1
        token = page["result"]["next_page_token"]
        if not token:
            break
    assert sum(states.values()) == expected, states
    token = None
    while True:
        page = (await http.get("/v1/nodes", params={"page_size": 500,
                                                    "page_token": token})).json()
        for node in page["result"]["nodes"]:
            report, sched = node["latest_report"], node["schedulable"]
            assert report["allocated"]["cpu_millis"] <= sched["cpu_millis"], node
            assert report["allocated"]["memory_bytes"] <= sched["memory_bytes"], node
        token = page["result"]["next_page_token"]
        if not token:
            break
    return states


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(args: argparse.Namespace, cluster: CtrlCluster, operator: str,
              workdir: Path) -> dict[str, Any]:
    """One measurement against `cluster`'s replicas; its figures."""
    urls = cluster.urls
    per_replica = args.concurrency // len(urls) + 8
    limits = httpx.Limits(max_connections=per_replica, max_keepalive_connections=per_replica)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(
            base_url=url, timeout=120, limits=limits,
            headers={"Authorization": f"Bearer {operator}"})) for url in urls]
        http = clients[0]
        t0 = time.monotonic()
        creds = await setup(http, args.nodes)
        print(f"enrolled {len(creds)} nodes in {time.monotonic() - t0:.1f}s", flush=True)
        creds_file = workdir / "creds.json"
        await trio.Path(creds_file).write_text(json.dumps(creds))
        nodes = subprocess.Popen(  # noqa: ASYNC220 - starting it does not block
            [sys.executable, str(HERE), "--role", "nodes", "--url", ",".join(urls),
             "--creds", str(creds_file)], stdout=subprocess.PIPE, start_new_session=True)
        pids = {**{f"ctrl-{n}": pid for n, pid in enumerate(cluster.pids, 1)},
                "nodes": nodes.pid, "load": os.getpid()}
        try:
            t0 = time.monotonic()
            await wait_eligible(http, args.nodes)
            print(f"{args.nodes} nodes eligible for placement in "
                  f"{time.monotonic() - t0:.1f}s", flush=True)
            body = {"template": "bench", "cpu_millis": args.cpu_millis,
                    "memory_bytes": args.memory_mib << 20, "layer_size_bytes": 1 << 30}
            warm = min(200, args.creates // 10)
            await load(clients, warm, args.concurrency, body, "warm")
            cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
            pg0 = cluster.postgres_cpu()
            elapsed, lat, errors = await load(clients, args.creates - warm, args.concurrency,
                                              body, "run")
            cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
            pg = cluster.postgres_cpu() - pg0
            done = len(lat) - sum(errors.values())
            await trio.sleep(2.0)  # let the last boots report
            states = await verify(http, args.creates - sum(errors.values()))
        finally:
            os.killpg(nodes.pid, signal.SIGTERM)
            nodes.wait(timeout=30)
    ms = [v * 1000 for v in lat]
    per = 1000 / max(done, 1)
    ctrl_cpu = sum(v for name, v in cpu.items() if name.startswith("ctrl-"))
    figures = {"store": cluster.store, "replicas": len(urls), "placements_s": done / elapsed,
               "p50_ms": percentile(ms, 0.5), "p99_ms": percentile(ms, 0.99),
               "ctrl_ms": ctrl_cpu * per, "postgres_ms": pg * per,
               "nodes_ms": cpu["nodes"] * per, "load_ms": cpu["load"] * per,
               "errors": errors, "states": states,
               "load_average": os.getloadavg()[0]}
    print(f"\n{cluster.store} x{len(urls)}: {done} placements in {elapsed:.2f}s: "
          f"{done / elapsed:.0f} placements/s (policy {args.policy}, {args.nodes} nodes, "
          f"concurrency {args.concurrency}, group commit {args.group_max or 'default'}, "
          f"switch interval {args.switch_interval or 'default'})")
    print(f"create latency: p50 {figures['p50_ms']:.1f} ms, p99 {figures['p99_ms']:.1f} "
          f"ms, mean {statistics.fmean(ms):.1f} ms")
    print(f"errors: {errors or 'none'}; Workspace states: {states}")
    print("CPU per placement: " + ", ".join(
        f"{name} {seconds * per:.2f} ms" for name, seconds in cpu.items())
        + (f", postgres {pg * per:.2f} ms" if cluster.postgres else "")
        + f" (machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})",
        flush=True)
    return figures


def measure(args: argparse.Namespace, store: str, replicas: int) -> dict[str, Any]:
    """Start a fresh cluster of `replicas` ctrl processes on `store`, measure, stop."""
    with tempfile.TemporaryDirectory(prefix="kibotos-bench-placement-") as tmp:
        cluster = CtrlCluster(Path(tmp), store)

        def spawn(replica_dir: Path, database_url: str, artifacts: Path | None,
                  first: bool) -> Spawned:
            return start_ctrl(replica_dir, args.policy, args.profile if first else None,
                              args.group_max, args.switch_interval, database_url, artifacts)

        try:
            cluster.start(replicas, spawn)
            _, url, config = cluster.replicas[0]
            operator = operator_credential(config, url)
            return trio.run(run, args, cluster, operator, Path(tmp))
        except BaseException:
            cluster.logs()
            raise
        finally:
            cluster.stop(signal.SIGUSR1 if args.profile else signal.SIGTERM)
            if args.profile:
                print(f"ctrl-1 profile written to {args.profile}")


def table(results: list[dict[str, Any]]) -> None:
    """Every combination's figures, each beside the first combination's (x1.00)."""
    base = results[0]
    print(f"\nplacements, {len(results)} combination(s); ratios against "
          f"{base['store']} x{base['replicas']} of this run")
    print(f"{'store':<11}{'replicas':>8}{'placed/s':>10}{'ratio':>7}{'p50 ms':>9}"
          f"{'p99 ms':>9}{'ctrl CPU ms':>13}{'ratio':>7}{'pg CPU ms':>11}{'nodes ms':>10}"
          f"{'load ms':>9}  checks")
    for r in results:
        ok = "passed" if not r["errors"] else f"errors {r['errors']}"
        print(f"{r['store']:<11}{r['replicas']:>8}{r['placements_s']:>10.0f}"
              f"{r['placements_s'] / base['placements_s']:>7.2f}{r['p50_ms']:>9.0f}"
              f"{r['p99_ms']:>9.0f}{r['ctrl_ms']:>13.2f}{r['ctrl_ms'] / base['ctrl_ms']:>7.2f}"
              f"{r['postgres_ms']:>11.2f}{r['nodes_ms']:>10.2f}{r['load_ms']:>9.2f}  {ok}")
    print("(targets: >= 1,500 placements/s, ctrl CPU <= 1.2 ms per placement)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--creates", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--policy", default="binpack")
    parser.add_argument("--cpu-millis", type=int, default=250)
    parser.add_argument("--memory-mib", type=int, default=256)
    parser.add_argument("--store", default="sqlite",
                        help="comma list of sqlite, postgresql (default sqlite)")
    parser.add_argument("--replicas", default="1",
                        help="comma list of ctrl replica counts (default 1; more than "
                             "one only on postgresql)")
    parser.add_argument("--profile", help="write ctrl-1's cProfile statistics to this file")
    parser.add_argument("--switch-interval", type=float,
                        help="ctrl's sys.setswitchinterval (s), for comparison")
    parser.add_argument("--group-max", type=int,
                        help="at most this many store writes per commit (1: no group "
                             "commit, for comparison)")
    parser.add_argument("--role", choices=["bench", "ctrl", "nodes"], default="bench",
                        help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--creds", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "ctrl":
        run_ctrl(args.config, args.profile, args.group_max, args.switch_interval)
        return
    if args.role == "nodes":
        trio.run(hold_sessions, args.url.split(","), args.creds)
        return
    stores = args.store.split(",")
    counts = [int(n) for n in args.replicas.split(",")]
    if not set(stores) <= {"sqlite", "postgresql"} or min(counts) < 1:
        parser.error("--store takes sqlite and postgresql, --replicas counts from 1")
    results = []
    for store in stores:
        for count in counts:
            if store == "sqlite" and count > 1:
                print(f"skipping sqlite x{count}: several replicas need PostgreSQL")
                continue
            results.append(measure(args, store, count))
    table(results)


if __name__ == "__main__":
    main()
