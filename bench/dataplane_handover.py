#!/usr/bin/env python3
"""What a node restart onto another build does to new data-plane connections: the
handover within a release line against the restart across release lines, in one run.

    .venv/bin/python bench/dataplane_handover.py [--rounds 3] [--json]

Real processes, as tests/dataplane/test_handover.py runs them (``direct`` supervisor,
``kibotos dataplane serve`` units, the real guest agent on a unix socket).  Each round
starts a node that finds generation N running and must replace it, once believing it
starts another build of the same release line (``HAND_OVER``: the new generation takes
over the listening socket) and once a build of another release line (``RESTART``: the
old one is ended, then the new one binds).  Meanwhile a prober opens new connections
back to back (a file ``stat`` each, one fresh TCP connection each) and counts those
that failed, and the longest stretch without a successful one.  An exec session open
on the old generation is checked afterwards: kept by the handover, dropped by the
restart.  Printed per kind: node start (``run()`` until started), connections made and
refused, the longest gap, and the ratios handover ÷ restart.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "dataplane")]

from dp_harness import Node, free_port, hand_over, running, running_agent  # noqa: E402

from kibotos._version import __version__  # noqa: E402
from kibotos.core.credentials import SigningKey  # noqa: E402
from kibotos.core.errors import KibotosError  # noqa: E402
from kibotos.dataplane.clients.client import Output, Started, open_exec  # noqa: E402
from kibotos.dataplane.clients.files_client import FilesClient  # noqa: E402
from kibotos.dataplane.endpoints.exec_session import ExecRequest  # noqa: E402
from kibotos.dataplane.process.state import Target  # noqa: E402
from kibotos.node.dataplane import supervisor as dps  # noqa: E402

KINDS = {"handover": f"{__version__}+bench-{{}}", "restart": "9.{}.0+bench"}


class Prober:
    """New connections back to back until stopped: how many failed, the longest gap."""

    def __init__(self, client: FilesClient) -> None:
        self.client = client
        self.made = self.failed = 0
        self.longest_gap = 0.0

    async def run(self, stop: trio.Event) -> None:
        last_ok = time.perf_counter()
        while not stop.is_set():
            try:
                await self.client.stat("/")
                now = time.perf_counter()
                self.longest_gap = max(self.longest_gap, now - last_ok)
                last_ok = now
            except (KibotosError, OSError):
                self.failed += 1
                await trio.sleep(0.005)
            self.made += 1


async def one_round(node: Node, target: Target, kind: str, build: str) -> dict[str, Any]:
    dps.source_build_id = lambda: build  # type: ignore[attr-defined]
    dp = node.dataplane()
    dp.preload([target])
    assert dp.generation is None
    plane_url = f"http://{node.listen}"
    creds = node.key.issue(workspace_id="ws-1", instance_id="inst-1", node_id="node-a",
                           operations=("exec", "files"))[0]
    prober = Prober(FilesClient(plane_url, creds))
    stop = trio.Event()
    async with open_exec(plane_url, creds, ExecRequest(("cat",))) as ex:
        assert isinstance(await ex.next_event(), Started)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prober.run, stop)
            await trio.sleep(0.3)  # connections before the restart
            t0 = time.perf_counter()
            async with running(dp):
                started = time.perf_counter() - t0
                await trio.sleep(0.3)  # and after it
            stop.set()
        kept = False
        try:
            await ex.send_stdin(b"x\n")
            event = await ex.next_event()
            kept = isinstance(event, Output) and event.data == b"x\n"
        except KibotosError:
            kept = False
    return {"kind": kind, "start_s": started, "made": prober.made, "refused": prober.failed,
            "longest_gap_s": prober.longest_gap, "open_session_kept": kept}


async def bench(rounds: int) -> list[dict[str, Any]]:
    base = Path(tempfile.mkdtemp(prefix="kdpb-", dir="/tmp"))
    (base / "state").mkdir()
    node = Node(base, f"127.0.0.1:{free_port()}", SigningKey.generate())
    results = []
    try:
        with running_agent(base) as agent:
            target = Target("inst-1", agent.socket, "ws-1")
            async with running(node.dataplane()) as first:
                await hand_over(node, first, agent)
            for i in range(rounds):
                for kind, pattern in KINDS.items():
                    results.append(await one_round(node, target, kind, pattern.format(i)))
                    await trio.sleep(0.5)
    finally:
        sup = node.supervisor()
        for info in await sup.list(""):
            await sup.stop(info.name, timeout=15)
        shutil.rmtree(base, ignore_errors=True)
    return results


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in KINDS:
        rows = [r for r in results if r["kind"] == kind]
        out[kind] = {"start_s": statistics.median(r["start_s"] for r in rows),
                     "made": sum(r["made"] for r in rows),
                     "refused": sum(r["refused"] for r in rows),
                     "longest_gap_s": max(r["longest_gap_s"] for r in rows),
                     "open_sessions_kept": sum(r["open_session_kept"] for r in rows),
                     "rounds": len(rows)}
    h, r = out["handover"], out["restart"]
    out["ratios"] = {"refused handover/restart": h["refused"] / max(r["refused"], 1),
                     "longest gap handover/restart": h["longest_gap_s"] / r["longest_gap_s"],
                     "node start handover/restart": h["start_s"] / r["start_s"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = summary(trio.run(bench, args.rounds))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for kind in KINDS:
        row = result[kind]
        print(f"{kind:9s} node start {row['start_s']:.2f}s (median)  connections "
              f"{row['made']} refused {row['refused']}  longest gap "
              f"{row['longest_gap_s'] * 1000:.0f} ms  open sessions kept "
              f"{row['open_sessions_kept']}/{row['rounds']}")
    for name, value in result["ratios"].items():
        print(f"{name}: {value:.3f}")


if __name__ == "__main__":
    main()
