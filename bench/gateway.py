#!/usr/bin/env python3
"""The E2B gateway against ``kibo``, in one run, on a one-node dev cluster (test VMM:
the real node, data plane and guest agent, the guest's processes on the host).

    .venv/bin/python bench/gateway.py [--runs 10] [--concurrent 20] [--json]

Prints, each as the gateway's figure, kibo's and their ratio (gateway ÷ kibo):

    create→output   Sandbox.create + commands.run("echo hi") through the SDK, against
                    kibo workspace create (it waits) + kibo workspace exec
    run(true)       the median round trip of commands.run("true") on a running
                    sandbox, against kibo workspace exec WS -- /bin/bash -l -c true, the
                    command the SDK runs (a CLI process each: kibo's figure includes
                    Python's start-up; under the test VMM the guest's processes run on
                    the host, so the host's login profile is most of both)
    start(true)     the gateway's own share: one envd Start of /bin/true (a Connect call
                    over a kept connection, no SDK), against the same exec straight on
                    the data plane (one WebSocket, in this process)
    write 8 MiB     files.write of 8 MiB of random bytes, against kibo workspace cp
    read 8 MiB      files.read of them, against kibo workspace cp back

and the creates of --concurrent sandboxes at once through the SDK (threads), p50 and
p99 of each create's time, with one create alone for comparison.  The baseline is
measured in the same run, on the same cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests" / "gateway")]

from benchlib import percentile  # noqa: E402
from conftest import NODE_ENV, _upload_tiny  # noqa: E402
from e2b import Sandbox  # noqa: E402
from gateway_proc import E2bSetup, e2b_cluster  # noqa: E402

from kibotos.dataplane.clients.client import open_exec  # noqa: E402
from kibotos.dataplane.clients.exec_wire import ExecRequest  # noqa: E402

#: What commands.run("cmd") sends (e2b 2.63.0): a login shell.
SDK_SHELL = ("/bin/bash", "-l", "-c")


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def kibo(setup: E2bSetup, *args: str) -> str:
    done = setup.cluster.kibo(*args, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"kibo {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def kibo_create(setup: E2bSetup) -> str:
    out = kibo(setup, "workspace", "create", "--template", "tiny", "--cpu", "0.5",
               "--memory", "128M", "--layer-size", "64M", "--json")
    return str(json.loads(out)["result"]["workspace_id"])


def kibo_delete(setup: E2bSetup, ws: str) -> None:
    kibo(setup, "workspace", "stop", ws, "--force")
    kibo(setup, "workspace", "delete", ws)


def gateway_start_true(setup: E2bSetup, sbx: Sandbox, runs: int) -> float:
    """The median of envd Start /bin/true through the gateway, one kept connection."""
    body = json.dumps({"process": {"cmd": "/bin/true"}, "stdin": False}).encode()
    envelope = struct.pack(">BI", 0, len(body)) + body
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id,
               "X-Access-Token": sbx._envd_access_token or "",
               "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
    url = setup.gateway.sandbox_url + "/process.Process/Start"
    with httpx.Client(timeout=60) as client:
        def start() -> None:
            answer = client.post(url, content=envelope, headers=headers)
            if answer.status_code != 200 or b'"exit status 0"' not in answer.content:
                raise SystemExit(f"Start /bin/true failed: {answer.content[:300]!r}")
        return statistics.median(timed(start) for _ in range(runs))


def dataplane_exec_true(setup: E2bSetup, ws: str, runs: int) -> float:
    """The median of the same exec straight on the data plane (a WebSocket each)."""
    session = setup.cluster.api("POST", f"/v1/workspaces/{ws}/sessions",
                                json={"operations": ["exec"]})
    request = ExecRequest(argv=("/bin/true",), env={}, cwd=None, tty=False, rows=24,
                          cols=80)

    async def run() -> list[float]:
        took = []
        for _ in range(runs):
            t0 = time.perf_counter()
            async with open_exec(session["dataplane_url"], session["credential"],
                                 request) as client:
                while await client.next_event() is not None:
                    pass
            took.append(time.perf_counter() - t0)
        return took

    return statistics.median(trio.run(run))


def measure(setup: E2bSetup, runs: int, concurrent: int, work: Path) -> dict[str, Any]:
    opts = setup.opts()
    out: dict[str, Any] = {}

    def sdk_first() -> None:
        sbx = Sandbox.create("base", **opts)
        sbx.commands.run("echo hi")
        created.append(sbx)

    created: list[Sandbox] = []
    ws_ids: list[str] = []

    def kibo_first() -> None:
        ws_ids.append(kibo_create(setup))
        kibo(setup, "workspace", "exec", ws_ids[-1], "--", "echo", "hi")

    out["create_to_output_s"] = (timed(sdk_first), timed(kibo_first))
    sbx, ws = created[0], ws_ids[0]
    out["run_true_s"] = (
        statistics.median(timed(lambda: sbx.commands.run("true")) for _ in range(runs)),
        statistics.median(timed(lambda: kibo(setup, "workspace", "exec", ws, "--",
                                             *SDK_SHELL, "true"))
                          for _ in range(runs)))
    out["start_true_s"] = (gateway_start_true(setup, sbx, runs),
                           dataplane_exec_true(setup, f"ws-{sbx.sandbox_id}", runs))
    blob = os.urandom(8 << 20)
    local = work / "blob.bin"
    local.write_bytes(blob)
    out["write_8mib_s"] = (timed(lambda: sbx.files.write("/tmp/blob.bin", blob)),
                           timed(lambda: kibo(setup, "workspace", "cp", str(local),
                                              f"{ws}:/tmp/blob.bin")))
    back = work / "back.bin"
    out["read_8mib_s"] = (timed(lambda: sbx.files.read("/tmp/blob.bin", format="bytes")),
                          timed(lambda: kibo(setup, "workspace", "cp", f"{ws}:/tmp/blob.bin",
                                             str(back))))
    sbx.kill()
    kibo_delete(setup, ws)

    alone: list[Sandbox] = []
    single = timed(lambda: alone.append(Sandbox.create("base", **opts)))
    alone[0].kill()

    def one_create(_: int) -> tuple[float, Sandbox]:
        t0 = time.perf_counter()
        made = Sandbox.create("base", **opts)
        return time.perf_counter() - t0, made

    with ThreadPoolExecutor(concurrent) as pool:
        results = list(pool.map(one_create, range(concurrent)))
    times = [t for t, _ in results]
    with ThreadPoolExecutor(concurrent) as pool:
        list(pool.map(lambda r: r[1].kill(), results))
    out["concurrent_create_s"] = {"alone": single, "count": concurrent,
                                  "p50": percentile(times, 0.5),
                                  "p99": percentile(times, 0.99)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--concurrent", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kbg", dir="/tmp"))
    up = {"nodes": 1, "reconcile_interval": "2s", "session_timeout": "5s",
          "test_inputs": True, "vmm_backend": "testvmm", "node_env": NODE_ENV,
          "cpu": "16", "memory": "8G"}
    try:
        with e2b_cluster("kbg", up, _upload_tiny, {"base": "tiny"}, memory_bytes=128 << 20,
                         layer_size_bytes=64 << 20) as setup:
            result = measure(setup, args.runs, args.concurrent, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name in ("create_to_output_s", "run_true_s", "start_true_s", "write_8mib_s",
                 "read_8mib_s"):
        gw, base = result[name]
        against = "dataplane" if name == "start_true_s" else "kibo"
        print(f"{name:20} gateway {gw:8.3f}  {against} {base:8.3f}  ratio {gw / base:6.2f}")
    c = result["concurrent_create_s"]
    print(f"{'concurrent creates':20} {c['count']} at once: p50 {c['p50']:.3f}s  p99 "
          f"{c['p99']:.3f}s  (one alone {c['alone']:.3f}s)")


if __name__ == "__main__":
    main()
