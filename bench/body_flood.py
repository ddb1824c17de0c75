"""ctrl's memory under a flood of large bodies to the unauthenticated enrollment
exchange (issue 16: a 200 MB body once took ctrl from 109 MB to 511 MB RSS).

    .venv/bin/python bench/body_flood.py [--bodies 20] [--size-mib 100]

Starts ``kibotos ctrl serve`` (SQLite) in a temporary directory, then sends `--bodies`
bodies of `--size-mib` MiB each to ``POST /v1/enrollment/exchange`` on raw sockets,
alternately with a ``Content-Length`` (ctrl must refuse it before reading) and chunked
(ctrl must stop at its 8 KiB limit); the client keeps sending until ctrl closes the
connection or the body is complete.  It prints ctrl's RSS (``/proc/<pid>/status``)
before, the highest seen after any body, and after, the bytes ctrl let the client
send before it answered, and the ratio of the highest RSS to the first: flat means a
ratio near 1.00 and a rise of a few MiB at most.

Measured on the 2-core test machine at load ~5, 20 bodies of 100 MiB: all 413, ctrl
103.4 MiB before, 103.8 MiB highest and after (ratio 1.00, +0.4 MiB).  The code before
issue 16 (read whole, then checked) held ~205 MiB after its first 100 MiB bodies and did
not finish four of them within 500 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from benchlib import spawn_ctrl

MIB = 1 << 20


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no VmRSS for {pid}")


def send_body(url: str, size: int, chunked: bool) -> tuple[int, int]:
    """One hostile request; returns ctrl's status and how many body bytes went out."""
    parts = urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    head = ["POST /v1/enrollment/exchange HTTP/1.1", f"Host: {parts.netloc}",
            "Content-Type: application/json"]
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}")
    piece = b"[" * MIB
    frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece
    sent = 0
    with socket.create_connection((parts.hostname, parts.port), timeout=300) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        try:
            while sent < size:
                sock.sendall(frame)
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            answer = sock.recv(4096)
        except (ConnectionResetError, TimeoutError):
            answer = b""
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
    return status, sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bodies", type=int, default=20)
    parser.add_argument("--size-mib", type=int, default=100)
    args = parser.parse_args()
    # A SIGTERM (timeout(1), CI) must still stop the ctrl this run started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="kibotos-flood-") as tmp:
        workdir = Path(tmp)
        proc, url, _ = spawn_ctrl(
            workdir, f'[ctrl]\nlisten = "127.0.0.1:0"\nstate_dir = "{workdir / "state"}"\n',
            [str(Path(sys.executable).with_name("kibotos")), "ctrl", "serve"])
        try:
            send_body(url, 1024, chunked=False)  # warm up: the first request's imports
            before = rss_mib(proc.pid)
            highest = before
            statuses: dict[int, int] = {}
            sent_most = 0
            for i in range(args.bodies):
                status, sent = send_body(url, args.size_mib * MIB, chunked=bool(i % 2))
                statuses[status] = statuses.get(status, 0) + 1
                sent_most = max(sent_most, sent)
                highest = max(highest, rss_mib(proc.pid))
            after = rss_mib(proc.pid)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    print(f"{args.bodies} bodies of {args.size_mib} MiB (half declared, half chunked): "
          f"statuses {statuses}")
    print(f"most body bytes sent before ctrl answered: {sent_most / MIB:.0f} MiB "
          "(socket buffers, not ctrl's memory)")
    print(f"ctrl RSS: before {before:.1f} MiB, highest {highest:.1f} MiB, after "
          f"{after:.1f} MiB; highest/before {highest / before:.2f}, "
          f"rise {highest - before:+.1f} MiB")


if __name__ == "__main__":
    main()
