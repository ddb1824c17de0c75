#!/usr/bin/env python3
"""The Exposure gateway ÷ the data plane's port stream it runs over, in one run, on a
one-node dev cluster (test VMM: the real node, data plane and guest agent; the
sandbox's server, `tests/gateway/exposure_server.py`, runs for real).

    .venv/bin/python bench/exposure.py [--runs 200] [--mib 128] [--json]

The same HTTP/1.1 client (h11, in this process) talks to the sandbox's server two
ways, interleaved run by run:

    gateway   TCP to the Exposure gateway, ``Host: <port>-<sandbox>.<domain>``
    direct    ``open_port`` on the data plane's ``/v1/ports/{port}`` with a session
              credential (what the gateway itself does per connection)

    round trip      GET /hello on a kept-alive connection (median, p90)
    new connection  a connection opened, GET /hello, closed (median, p90)
    download        MiB/s of --mib MiB from GET /blob
    upload          MiB/s of --mib MiB in POST /sha256

Ratios are gateway ÷ direct (latency: > 1 is slower through the gateway; throughput:
< 1 is slower).  Where the time goes: the gateway process's CPU milliseconds per MiB
moved during the throughput runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests" / "gateway")]

import h11  # noqa: E402
import trio  # noqa: E402
from benchlib import percentile  # noqa: E402
from conftest import NODE_ENV, _upload_tiny  # noqa: E402
from e2b import Sandbox  # noqa: E402
from exposure_proc import PATTERN, gateway_pid, serve  # noqa: E402
from gateway_proc import E2bSetup, e2b_cluster  # noqa: E402

from kibotos.cli.core import kibo_config  # noqa: E402
from kibotos.dataplane.clients.ports_client import open_port  # noqa: E402
from kibotos.tls.contexts import client_context  # noqa: E402

Opener = Callable[[], Any]  # an async context manager of a trio stream


async def exchange(stream: trio.abc.Stream, conn: h11.Connection, method: str, target: str,
                   host: str, upload: int = 0) -> tuple[int, int]:
    """One request (with `upload` bytes of body); (status, response body bytes)."""
    headers = [("host", host)] + ([("content-length", str(upload))] if upload else [])
    await stream.send_all(conn.send(h11.Request(method=method, target=target,
                                                headers=headers)))
    sent = 0
    while sent < upload:
        piece = PATTERN[:min(len(PATTERN), upload - sent)]
        await stream.send_all(conn.send(h11.Data(data=piece)))
        sent += len(piece)
    await stream.send_all(conn.send(h11.EndOfMessage()))
    status = got = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(bytes(await stream.receive_some(1 << 16)))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            got += len(event.data)
        elif isinstance(event, h11.EndOfMessage):
            conn.start_next_cycle()
            return status, got
        else:
            raise SystemExit(f"the server ended the exchange with {event!r}")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(setup: E2bSetup, sbx: Sandbox, port: int, runs: int,
                  mib: int) -> dict[str, Any]:
    host = sbx.get_host(port)
    gateway = urlsplit(setup.gateway.exposure_url)
    session = setup.cluster.api("POST", f"/v1/workspaces/ws-{sbx.sandbox_id}/sessions",
                                json={"operations": ["ports"]})

    @asynccontextmanager
    async def via_gateway() -> AsyncIterator[trio.abc.Stream]:
        stream = await trio.open_tcp_stream(gateway.hostname or "", gateway.port or 80)
        async with stream:
            yield stream

    # the data plane's certificate is from the cluster CA, as the gateway verifies it
    tls = client_context(kibo_config.load(setup.cluster.layout.kibo_config).cluster_ca)

    @asynccontextmanager
    async def direct() -> AsyncIterator[trio.abc.Stream]:
        async with open_port(session["dataplane_url"], session["credential"], port,
                             ssl_context=tls) as conn:
            yield conn

    ways: dict[str, Opener] = {"gateway": via_gateway, "direct": direct}
    out: dict[str, Any] = {}
    trips: dict[str, list[float]] = {w: [] for w in ways}
    fresh: dict[str, list[float]] = {w: [] for w in ways}
    streams: dict[str, tuple[trio.abc.Stream, h11.Connection]] = {}
    async with via_gateway() as g, direct() as d:
        streams = {"gateway": (g, h11.Connection(h11.CLIENT)),
                   "direct": (d, h11.Connection(h11.CLIENT))}
        for _ in range(runs):
            for way, (stream, conn) in streams.items():
                t0 = time.perf_counter()
                await exchange(stream, conn, "GET", "/hello", host)
                trips[way].append(time.perf_counter() - t0)
    for _ in range(max(10, runs // 10)):
        for way, opener in ways.items():
            t0 = time.perf_counter()
            async with opener() as stream:
                await exchange(stream, h11.Connection(h11.CLIENT), "GET", "/hello", host)
            fresh[way].append(time.perf_counter() - t0)
    for name, samples in (("round_trip_s", trips), ("new_connection_s", fresh)):
        out[name] = {w: {"median": statistics.median(v), "p90": percentile(v, 0.9)}
                     for w, v in samples.items()}
    size = mib << 20
    pid = gateway_pid(setup)
    for name, method, target, upload in (("download_mib_s", "GET", f"/blob?n={size}", 0),
                                         ("upload_mib_s", "POST", "/sha256", size)):
        rates, cpu = {}, 0.0
        for way, opener in ways.items():
            before = _cpu_s(pid)
            async with opener() as stream:
                t0 = time.perf_counter()
                await exchange(stream, h11.Connection(h11.CLIENT), method, target, host,
                               upload)
                rates[way] = mib / (time.perf_counter() - t0)
            if way == "gateway":
                cpu = _cpu_s(pid) - before
        out[name] = {**rates, "gateway_cpu_ms_per_mib": cpu * 1000 / mib}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    up = {"nodes": 1, "reconcile_interval": "2s", "session_timeout": "5s",
          "test_inputs": True, "vmm_backend": "testvmm", "node_env": NODE_ENV}
    with e2b_cluster("kbx", up, _upload_tiny, {"base": "tiny"}, memory_bytes=128 << 20,
                     layer_size_bytes=64 << 20) as setup:
        sbx = Sandbox.create("base", **setup.opts())
        try:
            port = serve(setup, sbx)
            result = trio.run(measure, setup, sbx, port, args.runs, args.mib)
        finally:
            sbx.kill()
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name in ("round_trip_s", "new_connection_s"):
        g, d = result[name]["gateway"], result[name]["direct"]
        print(f"{name:18} gateway {g['median'] * 1000:7.2f} ms (p90 {g['p90'] * 1000:7.2f})"
              f"  direct {d['median'] * 1000:7.2f} ms (p90 {d['p90'] * 1000:7.2f})"
              f"  ratio {g['median'] / d['median']:5.2f}")
    for name in ("download_mib_s", "upload_mib_s"):
        r = result[name]
        print(f"{name:18} gateway {r['gateway']:7.1f} MiB/s  direct {r['direct']:7.1f} MiB/s"
              f"  ratio {r['gateway'] / r['direct']:5.2f}  (gateway CPU "
              f"{r['gateway_cpu_ms_per_mib']:.1f} ms/MiB)")


if __name__ == "__main__":
    main()
