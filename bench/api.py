"""p50/p99 latency of `node list` and `node get` with 1,000 registered nodes on SQLite.

A real ctrl runs as its own process (``kibotos ctrl serve``); this process enrolls the
nodes through the HTTP API, holds 1,000 simulated control sessions
(`kibotos.testing.fake_node`), and then times the two read calls over loopback, one
request at a time, as an operator's `kibo` would make them.

    .venv/bin/python bench/api.py [--nodes 1000] [--requests 500] [--page-size 100]

Target (issue 2): p99 <= 50 ms for both.
"""

from __future__ import annotations

import argparse
import os
import signal
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio
from benchlib import ctrl_tls, enroll_node, operator_credential, percentile, spawn_ctrl

from kibotos.testing.fake_node import open_sim_node


async def enroll_nodes(url: str, operator: str, count: int, tls: ssl.SSLContext
                       ) -> list[tuple[str, str]]:
    headers = {"Authorization": f"Bearer {operator}"}
    creds: list[tuple[str, str]] = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60,
                                 verify=tls) as http:
        for i in range(count):
            node_id = f"node-{i:04d}"
            creds.append((node_id, await enroll_node(http, node_id)))
    return creds


async def hold_sessions(url: str, creds: list[tuple[str, str]], ready: trio.Event,
                        stop: trio.Event, tls: ssl.SSLContext) -> None:
    connected = 0

    async def one(node_id: str, credential: str) -> None:
        nonlocal connected
        async with open_sim_node(url, credential, node_id, incarnation=1,
                                 ping_interval=5.0, ssl_context=tls) as node:
            assert node.welcomed, node.first
            connected += 1
            if connected == len(creds):
                ready.set()
            await stop.wait()

    async with trio.open_nursery() as nursery:
        for node_id, credential in creds:
            nursery.start_soon(one, node_id, credential)
            await trio.lowlevel.checkpoint()


async def measure(url: str, operator: str, requests: int, page_size: int,
                  node_ids: list[str], tls: ssl.SSLContext) -> dict[str, list[float]]:
    headers = {"Authorization": f"Bearer {operator}"}
    timings: dict[str, list[float]] = {"node list": [], "node get": []}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60,
                                 verify=tls) as http:
        for _ in range(20):  # warm up connections and caches
            (await http.get("/v1/nodes", params={"page_size": page_size})).raise_for_status()
        for i in range(requests):
            t0 = time.perf_counter()
            resp = await http.get("/v1/nodes", params={"page_size": page_size})
            timings["node list"].append(time.perf_counter() - t0)
            resp.raise_for_status()
            assert len(resp.json()["result"]["nodes"]) == min(page_size, len(node_ids))
            node_id = node_ids[(i * 7919) % len(node_ids)]
            t0 = time.perf_counter()
            resp = await http.get(f"/v1/nodes/{node_id}")
            timings["node get"].append(time.perf_counter() - t0)
            resp.raise_for_status()
            assert resp.json()["result"]["status"] == "READY", resp.json()
    return timings


async def run(args: argparse.Namespace, url: str, operator: str, tls: ssl.SSLContext) -> None:
    t0 = time.monotonic()
    creds = await enroll_nodes(url, operator, args.nodes, tls)
    print(f"enrolled {len(creds)} nodes in {time.monotonic() - t0:.1f}s")
    ready, stop = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        t0 = time.monotonic()
        nursery.start_soon(hold_sessions, url, creds, ready, stop, tls)
        with trio.fail_after(300):
            await ready.wait()
        print(f"{len(creds)} sessions live in {time.monotonic() - t0:.1f}s")
        timings = await measure(url, operator, args.requests, args.page_size,
                                [n for n, _ in creds], tls)
        stop.set()
    print(f"\n{'call':<10} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for name, values in timings.items():
        ms = [v * 1000 for v in values]
        print(f"{name:<10} {len(ms):>5} {percentile(ms, 0.5):>8.1f} "
              f"{percentile(ms, 0.99):>8.1f} {statistics.fmean(ms):>8.1f}")
    print(f"(node list: page of {args.page_size} of {args.nodes} nodes; target p99 <= 50 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--page-size", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kibotos-bench-api-") as tmp:
        workdir = Path(tmp)
        proc, url, config = spawn_ctrl(
            workdir,
            f'[ctrl]\nlisten = "127.0.0.1:0"\nstate_dir = "{workdir / "state"}"\n'
            'reconcile_interval = "60s"\n',
            [str(Path(sys.executable).with_name("kibotos")), "ctrl", "serve"])
        try:
            operator = operator_credential(config, url)
            trio.run(run, args, url, operator, ctrl_tls(config))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
