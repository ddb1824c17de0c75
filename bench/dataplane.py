#!/usr/bin/env python3
"""The data plane ÷ the guest channel without it, in one run (targets: throughput ratios
≥ 0.8, exec round trip ≤ 1.5).

    .venv/bin/python bench/dataplane.py [--mib 128] [--requests 300] [--runs 3] [--plain]
        [--json]

Everything runs on this machine as real processes: the guest agent (``agent.py
--socket``, under the guest's ``python3``, its root in /dev/shm so the disk takes no
part), ``kibotos dataplane serve`` on loopback, and a TCP server standing in for the
guest's (a separate process, so it takes no time from the client's).  The client is
this process.  The agent runs on the host rather than in a VM on purpose: under TCG it
is 10-17x slower and would hide the data plane entirely, whereas here the data plane's
own cost is what the ratios show.  Each figure is measured both ways, interleaved run
by run:

    direct   a `GuestChannel` on the agent's socket: what the data plane itself does
             (``guest.ports.open``, ``guest.files.open_write``/``open_read``, ``guest.run``)
    plane    the data plane's endpoints, with the clients kibo uses: ``open_port``
             (``/v1/ports/{port}``), `FilesClient` (``/v1/files/content``), ``open_exec``,
             over TLS as a node serves it (a certificate of a cluster CA made for the
             run, verified by the clients), or plain HTTP with ``--plain``

    files up/down   MiB/s of a `--mib` MiB file written into / read out of the guest,
                    with its digest checked at the end
    ports up/down   MiB/s of `--mib` MiB to a server that reads to EOF / from a server
                    that sends them
    round trip      100 bytes there and back on an open forwarded connection
    request         a new forwarded connection, 100 bytes there, 100 back, its end
    exec            ``true`` started in the guest, to its exit status

The ratios are plane ÷ direct (for latencies > 1 means slower through the plane).  For
the throughput runs it also prints where the time goes: the CPU milliseconds per MiB
each process spent (agent, data plane, server, client), which hold up on a busy
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
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import trio  # noqa: E402

from bench.benchlib import percentile  # noqa: E402
from kibotos.core.credentials import SigningKey  # noqa: E402
from kibotos.dataplane.clients.client import open_exec  # noqa: E402
from kibotos.dataplane.clients.exec_wire import ExecRequest  # noqa: E402
from kibotos.dataplane.clients.files_client import FilesClient  # noqa: E402
from kibotos.dataplane.clients.ports_client import open_port  # noqa: E402
from kibotos.dataplane.endpoints.files_api import DOWNLOAD_WINDOW, UPLOAD_WINDOW  # noqa: E402
from kibotos.dataplane.endpoints.ports_session import PORT_WINDOW  # noqa: E402
from kibotos.dataplane.process.control import control_call, control_path  # noqa: E402
from kibotos.dataplane.process.state import Target, state_message  # noqa: E402
from kibotos.guest import (  # noqa: E402
    AGENT_PATH,
    ExitStatus,
    GuestChannel,
    connect_unix_with_retry,
    open_guest_channel,
)
from kibotos.tls.ca import ClusterCA  # noqa: E402
from kibotos.tls.contexts import client_context  # noqa: E402

GUEST_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
NODE, INSTANCE, WORKSPACE = "node-bench", "inst-bench", "ws-bench"
SMALL = 100
BLOCK = 1 << 18  # what the client hands over at a time
THROUGHPUT = ("files_up", "files_down", "ports_up", "ports_down")
LATENCY = ("round_trip", "request", "exec")

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Processes:
    """The agent, the data plane and the server; all stopped at the end."""

    def __init__(self, work: Path, guest_root: Path, *, tls: bool = True) -> None:
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
                     "--root", str(guest_root), "--log-level", "WARNING"], log)
        self._spawn([sys.executable, "-m", "kibotos.cli.main", "dataplane", "serve",
                     "--listen", self.listen, "--socket-dir", str(self.socket_dir),
                     "--generation", "1", *([] if tls else ["--plain"])], log)
        server = self._spawn([sys.executable, "-c", SERVER], log, stdout=subprocess.PIPE)
        assert server.stdout is not None
        self.server_port = int(server.stdout.readline())

    def _spawn(self, argv: list[str], log: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
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
                              operations=("ports", "files", "exec"))[0]

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


class Way(Protocol):
    """One way of reaching the guest: the same operations, directly on the guest
    channel (`Direct`) or through the data plane (`Plane`)."""

    def open_port(self) -> Any: ...  # an async context manager of a HalfCloseableStream

    async def upload(self, path: str, size: int) -> None: ...

    async def download(self, path: str) -> int: ...

    async def exec_true(self) -> None: ...


def blocks(size: int) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        block = b"\x33" * BLOCK
        left = size
        while left > 0:
            yield block[:left]
            left -= BLOCK
    return gen()


class Direct:
    def __init__(self, guest: GuestChannel, port: int) -> None:
        self.guest, self.port = guest, port

    @asynccontextmanager
    async def open_port(self) -> Any:
        async with await self.guest.ports.open(self.port, window=PORT_WINDOW) as conn:
            yield conn

    async def upload(self, path: str, size: int) -> None:
        import hashlib

        digest = hashlib.sha256()  # what FilesClient computes while sending
        async with await self.guest.files.open_write(path, window=UPLOAD_WINDOW) as up:
            async for chunk in blocks(size):
                digest.update(chunk)
                await up.stream.send_all(chunk)
            result = await up.commit("sha256:" + digest.hexdigest())
        assert result.bytes == size, result

    async def download(self, path: str) -> int:
        import hashlib

        digest = hashlib.sha256()  # what FilesClient checks at the end
        got = 0
        async with await self.guest.files.open_read(path, window=DOWNLOAD_WINDOW) as down:
            while chunk := await down.stream.receive_some():
                digest.update(chunk)
                got += len(chunk)
            result = await down.result()
        assert result.sha256 == "sha256:" + digest.hexdigest(), result
        return got

    async def exec_true(self) -> None:
        status, _, _ = await self.guest.run(["true"])
        assert status.exit_code == 0, status


class Plane:
    def __init__(self, procs: Processes) -> None:
        self.procs = procs
        self.url = procs.url
        self.tls = procs.client_tls
        self.credential = procs.credential()  # one, as a gateway or kibo holds one

    def open_port(self) -> Any:
        return open_port(self.url, self.credential, self.procs.server_port,
                         host="127.0.0.1", ssl_context=self.tls)

    async def upload(self, path: str, size: int) -> None:
        files = FilesClient(self.url, self.credential, ssl_context=self.tls)
        answer = await files.upload("content", path, blocks(size))
        assert answer["bytes"] == size, answer

    async def download(self, path: str) -> int:
        files = FilesClient(self.url, self.credential, ssl_context=self.tls)
        async with files.download("content", path) as down:
            async for _ in down.chunks():
                pass
        return down.received

    async def exec_true(self) -> None:
        async with open_exec(self.url, self.credential, ExecRequest(argv=("true",)),
                             ssl_context=self.tls) as client:
            async for event in client.events():
                if isinstance(event, ExitStatus):
                    assert event.returncode == 0, event
                    return
        raise AssertionError("the exec ended without an exit status")


async def read_all(stream: trio.abc.ReceiveStream) -> int:
    total = 0
    while chunk := await stream.receive_some(1 << 20):
        total += len(chunk)
    return total


async def ports_down(way: Way, size: int) -> float:
    async with way.open_port() as conn:
        start = time.perf_counter()
        await conn.send_all(b"D%d\n" % size)
        await conn.send_eof()
        got = await read_all(conn)
        elapsed = time.perf_counter() - start
    assert got == size, (got, size)
    return size / elapsed / (1 << 20)


async def ports_up(way: Way, size: int) -> float:
    async with way.open_port() as conn:
        start = time.perf_counter()
        await conn.send_all(b"U")
        async for block in blocks(size):
            await conn.send_all(block)
        await conn.send_eof()
        answer = b""
        while chunk := await conn.receive_some():
            answer += chunk
        elapsed = time.perf_counter() - start
    assert int(answer) == size, (answer, size)
    return size / elapsed / (1 << 20)


async def files_up(way: Way, size: int) -> float:
    start = time.perf_counter()
    await way.upload("/bench.bin", size)
    return size / (time.perf_counter() - start) / (1 << 20)


async def files_down(way: Way, size: int) -> float:
    start = time.perf_counter()
    got = await way.download("/bench.bin")
    elapsed = time.perf_counter() - start
    assert got == size, (got, size)
    return size / elapsed / (1 << 20)


async def round_trips(way: Way, count: int) -> list[float]:
    times = []
    message = b"r" * SMALL
    async with way.open_port() as conn:
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


async def requests(way: Way, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        async with way.open_port() as conn:
            await conn.send_all(b"E" + b"q" * (SMALL - 1))
            await conn.send_eof()
            assert await read_all(conn) == SMALL - 1
        times.append(time.perf_counter() - start)
    return times


async def execs(way: Way, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        await way.exec_true()
        times.append(time.perf_counter() - start)
    return times


async def bench(args: argparse.Namespace, procs: Processes) -> dict[str, Any]:
    await procs.hand_state()
    stream = await connect_unix_with_retry(procs.agent_socket, trio.current_time() + 30)
    async with open_guest_channel(stream) as guest:
        await guest.wait_hello(trio.current_time() + 30)
        return await _measure(args, procs, {"direct": Direct(guest, procs.server_port),
                                            "plane": Plane(procs)})


class Tally:
    """The figures of every run, and the CPU each process spent on the throughput runs."""

    ROLES = ("agent", "plane", "server")

    def __init__(self, procs: Processes) -> None:
        self.procs = procs
        self.results: dict[str, dict[str, list[float]]] = {
            name: {"direct": [], "plane": []} for name in (*THROUGHPUT, *LATENCY)}
        self.cpu = {name: {way: dict.fromkeys((*self.ROLES, "client"), 0.0)
                           for way in ("direct", "plane")} for name in THROUGHPUT}

    async def both(self, name: str, ways: dict[str, Way],
                   run: Callable[[Way], Awaitable[Any]]) -> None:
        for way_name, way in ways.items():
            before = [cpu_seconds(p.pid) for p in self.procs.procs]
            mine = time.process_time()
            outcome = await run(way)
            if name in self.cpu:
                spent = self.cpu[name][way_name]
                spent["client"] += time.process_time() - mine
                for role, proc, start in zip(self.ROLES, self.procs.procs, before,
                                             strict=True):
                    spent[role] += cpu_seconds(proc.pid) - start
            self.results[name][way_name].extend(
                outcome if isinstance(outcome, list) else [outcome])


async def _measure(args: argparse.Namespace, procs: Processes,
                   ways: dict[str, Way]) -> dict[str, Any]:
    size = args.mib << 20
    warm = Tally(procs)  # warm both paths up; its figures are dropped
    await warm.both("files_up", ways, lambda w: files_up(w, 16 << 20))
    await warm.both("ports_down", ways, lambda w: ports_down(w, 16 << 20))
    await warm.both("request", ways, lambda w: requests(w, 20))
    await warm.both("exec", ways, lambda w: execs(w, 5))
    tally = Tally(procs)
    for _ in range(args.runs):
        await tally.both("files_up", ways, lambda w: files_up(w, size))
        await tally.both("files_down", ways, lambda w: files_down(w, size))
        await tally.both("ports_down", ways, lambda w: ports_down(w, size))
        await tally.both("ports_up", ways, lambda w: ports_up(w, size))
        await tally.both("round_trip", ways, lambda w: round_trips(w, args.requests))
        await tally.both("request", ways, lambda w: requests(w, args.requests // 5))
        await tally.both("exec", ways, lambda w: execs(w, args.requests // 10))
    return summarize(args, tally)


def summarize(args: argparse.Namespace, tally: Tally) -> dict[str, Any]:
    summary: dict[str, Any] = {"mib": args.mib, "runs": args.runs,
                               "window_kib": PORT_WINDOW >> 10}
    moved = args.runs * args.mib
    for name in THROUGHPUT:
        rates = tally.results[name]
        direct_rate, plane_rate = (statistics.median(rates[w]) for w in ("direct", "plane"))
        summary[name] = {
            "direct_mib_s": round(direct_rate, 1), "plane_mib_s": round(plane_rate, 1),
            "ratio": round(plane_rate / direct_rate, 2),
            "ratios": [round(p / d, 2) for d, p in zip(rates["direct"], rates["plane"],
                                                        strict=True)],
            "cpu_ms_per_mib": {way: {role: round(spent * 1e3 / moved, 2)
                                     for role, spent in tally.cpu[name][way].items()}
                               for way in ("direct", "plane")}}
    for name in LATENCY:
        d, p = tally.results[name]["direct"], tally.results[name]["plane"]
        summary[name] = {
            "direct_ms": {"median": round(statistics.median(d) * 1e3, 3),
                          "p90": round(percentile(d, 0.9) * 1e3, 3)},
            "plane_ms": {"median": round(statistics.median(p) * 1e3, 3),
                         "p90": round(percentile(p, 0.9) * 1e3, 3)},
            "ratio": round(statistics.median(p) / statistics.median(d), 2)}
    return summary


def report(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    print(f"the data plane ÷ the guest channel directly ({args.runs} runs, {args.mib} MiB, "
          f"window {summary['window_kib']} KiB; load average {os.getloadavg()[0]:.1f})")
    for name in THROUGHPUT:
        row = summary[name]
        spread = " ".join(f"{r:.2f}" for r in row["ratios"])
        print(f"  {name:<11} direct {row['direct_mib_s']:>7.1f} MiB/s   plane "
              f"{row['plane_mib_s']:>7.1f} MiB/s   ratio {row['ratio']:.2f}  (target ≥ 0.8;"
              f" runs {spread})")
        for way in ("direct", "plane"):
            spent = row["cpu_ms_per_mib"][way]
            total = sum(spent.values())
            parts = "  ".join(f"{role} {ms:.2f}" for role, ms in spent.items()
                              if way == "plane" or role != "plane")
            print(f"              CPU ms/MiB {way:<6} {parts}  (all {total:.2f})")
    for name in LATENCY:
        row = summary[name]
        target = "  (target ≤ 1.5)" if name == "exec" else ""
        print(f"  {name:<11} direct {row['direct_ms']['median']:>7.3f} ms (p90 "
              f"{row['direct_ms']['p90']:.3f})   plane {row['plane_ms']['median']:>7.3f} ms "
              f"(p90 {row['plane_ms']['p90']:.3f})   ratio {row['ratio']:.2f}{target}")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=128, help="MiB per throughput run")
    parser.add_argument("--requests", type=int, default=300,
                        help="round trips per run (requests: a fifth; execs: a tenth)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--plain", action="store_true",
                        help="plain HTTP on loopback instead of TLS")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kdp-bench-", dir="/tmp"))
    shm = Path("/dev/shm")
    guest_root = Path(tempfile.mkdtemp(prefix="kdp-guest-", dir=shm if shm.is_dir()
                                       else work))
    procs = Processes(work, guest_root, tls=not args.plain)
    try:
        summary = trio.run(bench, args, procs)
    finally:
        procs.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(guest_root, ignore_errors=True)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        report(args, summary)


if __name__ == "__main__":
    main()
