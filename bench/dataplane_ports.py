#!/usr/bin/env python3
"""Port forwarding through the data plane ÷ the same over the guest channel directly
(targets: throughput ratios ≥ 0.8).

    .venv/bin/python bench/dataplane_ports.py [--mib 256] [--requests 500] [--plain] [--json]

Everything runs on this machine as real processes: the guest agent (``agent.py
--socket``, under the guest's ``python3``), ``kibotos dataplane serve`` on loopback,
and a TCP server standing in for the guest's (a separate process, so it takes no time
from the client's).  The client is this process.  Each figure is measured both ways,
interleaved run by run:

    direct   a `GuestChannel` on the agent's socket, ``guest.ports.open(port)``, what the
             data plane itself does
    plane    ``open_port`` through the data plane's ``/v1/ports/{port}`` WebSocket, over
             TLS as a node serves it (a certificate of a cluster CA made for the run,
             verified by the client), or plain HTTP with ``--plain``

    download      MiB/s of `--mib` MiB the server sends, read to its end
    upload        MiB/s of `--mib` MiB sent to a server that reads to EOF and answers
    round trip    100 bytes there and back on an open connection (median, p90)
    request       a new connection, 100 bytes there, 100 back, its end (median, p90)

The ratios are plane ÷ direct (for latency > 1 means slower through the plane).  For
the throughput runs it also prints where the time goes: the CPU milliseconds per MiB
each process spent (agent, data plane, client, server), which hold up on a busy
machine better than the rates do.  On a machine with fewer cores than the pipeline has
busy processes, the rate through the plane is bounded by all of them together.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import trio  # noqa: E402

from kibotos.credentials import SigningKey  # noqa: E402
from kibotos.dataplane.control import control_call, control_path  # noqa: E402
from kibotos.dataplane.ports_client import open_port  # noqa: E402
from kibotos.dataplane.ports_session import PORT_WINDOW  # noqa: E402
from kibotos.dataplane.state import Target, state_message  # noqa: E402
from kibotos.guest import (  # noqa: E402
    AGENT_PATH,
    GuestChannel,
    connect_unix_with_retry,
    open_guest_channel,
)
from kibotos.tls.ca import ClusterCA  # noqa: E402
from kibotos.tls.contexts import client_context  # noqa: E402

GUEST_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
NODE, INSTANCE, WORKSPACE = "node-bench", "inst-bench", "ws-bench"
SMALL = 100

#: The stand-in for the guest's server: per connection, the first byte says what to do.
#: ``D<n>\n`` send n bytes and close; ``U`` read to EOF, answer the count; ``E`` echo
#: what arrives until EOF.  Threads, blocking sockets: nothing of it runs in the client.
SERVER = r"""
import socket, sys, threading
BLOCK = b"\x5a" * (1 << 20)
def handle(conn):
    with conn:
        mode = conn.recv(1)
        if mode == b"D":
            line = b""
            while not line.endswith(b"\n"):
                line += conn.recv(1)
            left = int(line)
            while left > 0:
                left -= conn.send(BLOCK[:min(left, len(BLOCK))])
        elif mode == b"U":
            total = 0
            while data := conn.recv(1 << 20):
                total += len(data)
            conn.sendall(str(total).encode())
        elif mode == b"E":
            while data := conn.recv(1 << 16):
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
while True:
    c, _ = srv.accept()
    threading.Thread(target=handle, args=(c,), daemon=True).start()
"""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Opener = Callable[[], Any]  # an async context manager of a HalfCloseableStream


async def read_all(stream: trio.abc.ReceiveStream) -> int:
    total = 0
    while chunk := await stream.receive_some(1 << 20):
        total += len(chunk)
    return total


async def download(open_conn: Opener, size: int) -> float:
    async with open_conn() as conn:
        start = time.perf_counter()
        await conn.send_all(b"D%d\n" % size)
        await conn.send_eof()
        got = await read_all(conn)
        elapsed = time.perf_counter() - start
    assert got == size, (got, size)
    return size / elapsed / (1 << 20)


async def upload(open_conn: Opener, size: int) -> float:
    block = b"\0" * (1 << 18)
    async with open_conn() as conn:
        start = time.perf_counter()
        await conn.send_all(b"U")
        left = size
        while left > 0:
            await conn.send_all(block[:left])
            left -= len(block)
        await conn.send_eof()
        answer = b""
        while chunk := await conn.receive_some():
            answer += chunk
        elapsed = time.perf_counter() - start
    assert int(answer) == size, (answer, size)
    return size / elapsed / (1 << 20)


async def round_trips(open_conn: Opener, count: int) -> list[float]:
    times = []
    message = b"r" * SMALL
    async with open_conn() as conn:
        await conn.send_all(b"E")
        for _ in range(count):
            start = time.perf_counter()
            await conn.send_all(message)
            got = 0
            while got < SMALL:
                got += len(await conn.receive_some())
            times.append(time.perf_counter() - start)
        await conn.send_eof()
        await read_all(conn)
    return times


async def requests(open_conn: Opener, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        async with open_conn() as conn:
            await conn.send_all(b"E" + b"q" * (SMALL - 1))
            await conn.send_eof()
            assert await read_all(conn) == SMALL - 1
        times.append(time.perf_counter() - start)
    return times


class Processes:
    """The agent, the data plane and the server; all stopped at the end."""

    def __init__(self, work: Path, *, tls: bool = True) -> None:
        self.work = work
        self.ca = ClusterCA.generate() if tls else None
        self.client_tls = client_context(self.ca.cert_pem) if self.ca else None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.agent_socket = work / "agent-dp.sock"
        self.listen = f"127.0.0.1:{free_port()}"
        self.socket_dir = work / "run"
        self.key = SigningKey.generate()
        log = open(work / "bench.log", "ab")  # noqa: SIM115 - lives as long as the processes
        self._spawn([GUEST_PYTHON, str(AGENT_PATH), "--socket", str(self.agent_socket),
                     "--root", str(work / "root"), "--log-level", "WARNING"], log)
        self._spawn([sys.executable, "-m", "kibotos.cli.main", "dataplane", "serve",
                     "--listen", self.listen, "--socket-dir", str(self.socket_dir),
                     "--generation", "1", *([] if tls else ["--plain"])], log)
        server = self._spawn([sys.executable, "-c", SERVER], log, stdout=subprocess.PIPE)
        assert server.stdout is not None
        self.server_port = int(server.stdout.readline())

    def _spawn(self, argv: list[str], log: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        (self.work / "root").mkdir(exist_ok=True)
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=log,
                                stdout=kwargs.pop("stdout", log), cwd=ROOT, **kwargs)
        self.procs.append(proc)
        return proc

    async def hand_state(self) -> None:
        path = control_path(self.socket_dir)
        with trio.fail_after(60):
            while True:
                try:
                    await control_call(path, {"type": "status"}, timeout=5)
                    break
                except Exception:
                    await trio.sleep(0.05)
        await control_call(path, state_message(1, NODE, self.key.public_key, [
            Target(INSTANCE, self.agent_socket, WORKSPACE)]), timeout=30)
        if self.ca is not None:  # what the node's certificate keeper sends
            issued = self.ca.issue(["127.0.0.1"], lifetime=dt.timedelta(hours=1))
            assert issued.key_pem is not None
            await control_call(path, {"type": "certificate",
                                      "certificate": issued.cert_pem.decode(),
                                      "key": issued.key_pem.decode()}, timeout=30)

    @property
    def url(self) -> str:
        return f"{'https' if self.ca else 'http'}://{self.listen}"

    def credential(self) -> str:
        return self.key.issue(workspace_id=WORKSPACE, instance_id=INSTANCE, node_id=NODE,
                              operations=("ports",))[0]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def bench(args: argparse.Namespace, procs: Processes) -> dict[str, Any]:
    await procs.hand_state()
    stream = await connect_unix_with_retry(procs.agent_socket, trio.current_time() + 30)
    async with open_guest_channel(stream) as guest:
        await guest.wait_hello(trio.current_time() + 30)
        return await _measure(args, procs, guest)


async def _measure(args: argparse.Namespace, procs: Processes,
                   guest: GuestChannel) -> dict[str, Any]:
    from contextlib import asynccontextmanager

    port = procs.server_port
    url = procs.url

    @asynccontextmanager
    async def direct() -> Any:
        conn = await guest.ports.open(port, window=PORT_WINDOW)
        async with conn:
            yield conn

    def plane() -> Any:
        return open_port(url, procs.credential(), port, host="127.0.0.1",
                         ssl_context=procs.client_tls)

    size = args.mib << 20
    results: dict[str, dict[str, list[float]]] = {
        name: {"direct": [], "plane": []}
        for name in ("download", "upload", "round_trip", "request")}
    roles = ("agent", "plane", "server")
    cpu: dict[str, dict[str, dict[str, float]]] = {
        name: {way: dict.fromkeys((*roles, "client"), 0.0) for way in ("direct", "plane")}
        for name in ("download", "upload")}

    async def both(name: str, run: Callable[[Opener], Awaitable[Any]]) -> None:
        for way, opener in (("direct", direct), ("plane", plane)):
            before = [cpu_seconds(p.pid) for p in procs.procs]
            mine = time.process_time()
            outcome = await run(opener)
            if name in cpu:
                spent = cpu[name][way]
                spent["client"] += time.process_time() - mine
                for role, proc, start in zip(roles, procs.procs, before, strict=True):
                    spent[role] += cpu_seconds(proc.pid) - start
            results[name][way].extend(outcome if isinstance(outcome, list) else [outcome])

    await both("download", lambda o: download(o, 16 << 20))  # warm both paths up
    await both("request", lambda o: requests(o, 20))
    results = {name: {"direct": [], "plane": []} for name in results}
    for name in cpu:
        cpu[name] = {way: dict.fromkeys((*roles, "client"), 0.0) for way in cpu[name]}
    for _ in range(args.runs):
        await both("download", lambda o: download(o, size))
        await both("upload", lambda o: upload(o, size))
        await both("round_trip", lambda o: round_trips(o, args.requests))
        await both("request", lambda o: requests(o, args.requests // 5))
    summary: dict[str, Any] = {"mib": args.mib, "runs": args.runs, "tls": not args.plain,
                               "window_kib": PORT_WINDOW >> 10}
    for name in ("download", "upload"):
        direct_rate = statistics.median(results[name]["direct"])
        plane_rate = statistics.median(results[name]["plane"])
        moved = args.runs * args.mib
        summary[name] = {"direct_mib_s": round(direct_rate, 1),
                         "plane_mib_s": round(plane_rate, 1),
                         "ratio": round(plane_rate / direct_rate, 2),
                         "cpu_ms_per_mib": {
                             way: {role: round(spent * 1e3 / moved, 2)
                                   for role, spent in cpu[name][way].items()}
                             for way in ("direct", "plane")}}
    for name in ("round_trip", "request"):
        d, p = results[name]["direct"], results[name]["plane"]
        summary[name] = {
            "direct_ms": {"median": round(statistics.median(d) * 1e3, 3),
                          "p90": round(percentile(d, 0.9) * 1e3, 3)},
            "plane_ms": {"median": round(statistics.median(p) * 1e3, 3),
                         "p90": round(percentile(p, 0.9) * 1e3, 3)},
            "ratio": round(statistics.median(p) / statistics.median(d), 2)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB per throughput run")
    parser.add_argument("--requests", type=int, default=500,
                        help="round trips per run (requests: a fifth of it)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--plain", action="store_true",
                        help="the data plane without TLS (as on loopback with dataplane_tls "
                             "= false), to see what TLS costs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kdp-ports-", dir="/tmp"))
    procs = Processes(work, tls=not args.plain)
    try:
        summary = trio.run(bench, args, procs)
    finally:
        procs.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"port forwarding through the data plane ÷ over the guest channel directly "
          f"({args.runs} runs, {args.mib} MiB, window {summary['window_kib']} KiB)")
    for name in ("download", "upload"):
        row = summary[name]
        print(f"  {name:<11} direct {row['direct_mib_s']:>7.1f} MiB/s   plane "
              f"{row['plane_mib_s']:>7.1f} MiB/s   ratio {row['ratio']:.2f}  (target ≥ 0.8)")
        for way in ("direct", "plane"):
            spent = row["cpu_ms_per_mib"][way]
            total = sum(spent.values())
            parts = "  ".join(f"{role} {ms:.2f}" for role, ms in spent.items()
                              if way == "plane" or role != "plane")
            print(f"              CPU ms/MiB {way:<6} {parts}  (all {total:.2f})")
    for name in ("round_trip", "request"):
        row = summary[name]
        print(f"  {name:<11} direct {row['direct_ms']['median']:>7.3f} ms (p90 "
              f"{row['direct_ms']['p90']:.3f})   plane {row['plane_ms']['median']:>7.3f} ms "
              f"(p90 {row['plane_ms']['p90']:.3f})   ratio {row['ratio']:.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
