"""The "VM" of the ``testvmm`` backend: prepares a guest root, then becomes the agent.

Standard library only: it is the main program of a unit the supervisor starts with an
empty environment.  It execs the real guest agent (`kibotos/guest/agent.py`) in place,
so the unit's MainPID *is* the agent and everything the node does with a guest (hello,
configure, exec, stop_prepare, sync) runs for real, without QEMU.

    python3 testvmm_guest.py --agent AGENT --socket SOCK --root DIR [--hang] [--refuse]
                             [--write BLOCKFILE --tag TAG]...

``--hang`` never starts the agent (a guest that does not come up: the readiness wait
times out); ``--refuse`` starts it announcing protocol version 0, outside what the
host accepts.

``--write`` (the backend's ``write_records`` option, one per writable disk) forks a
writer before the agent starts, in the unit's process group, so it ends with the unit
like a VMM's I/O thread: it appends fixed-size records ``<tag> <seq> <unix time>`` to
the block file's record region (`RECORDS_AT`, continuing after the last record found
there), each made durable with fdatasync, every `WRITE_INTERVAL` s until killed.
`read_records` reads them back: the fencing tests check that no write of an old holder
lands after the new holder opened.

The data plane's agent socket, ``agent-dp.sock`` beside the agent's socket, is a symlink
to it: with ``--socket`` the agent serves every connection as its own session, which is
what the second virtio port (``org.kibotos.agent.1``) gives the data plane in a real VM.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time

#: Where the record region starts in the block file, and its slot size and length.
RECORDS_AT = 1 << 20
RECORD = 64
SLOTS = 16384
WRITE_INTERVAL = 0.02


def read_stamped(path: str) -> list[tuple[str, int, float]]:
    """The (tag, seq, unix time) records in `path`'s region, up to the first slot that
    holds none (all zero, or whatever the file system had there)."""
    out = []
    with open(path, "rb") as f:
        f.seek(RECORDS_AT)
        region = f.read(RECORD * SLOTS)
    for i in range(0, len(region) - RECORD + 1, RECORD):
        try:
            tag, seq, stamp = region[i:i + RECORD].decode().split()
            out.append((tag, int(seq), float(stamp)))
        except ValueError:  # also UnicodeDecodeError
            break
    return out


def read_records(path: str) -> list[tuple[str, int]]:
    """The (tag, seq) records in `path`'s region (`read_stamped`)."""
    return [(tag, seq) for tag, seq, _ in read_stamped(path)]


def _write_forever(paths: list[str], tag: str) -> None:
    fds = [os.open(p, os.O_RDWR) for p in paths]
    slots = [len(read_records(p)) for p in paths]
    seq = 0
    while True:
        for i, fd in enumerate(fds):
            if slots[i] >= SLOTS:
                continue
            rec = f"{tag} {seq} {time.time():.6f}".encode().ljust(RECORD - 1) + b"\n"
            os.pwrite(fd, rec, RECORDS_AT + slots[i] * RECORD)
            os.fdatasync(fd)
            slots[i] += 1
        seq += 1
        time.sleep(WRITE_INTERVAL)


def _start_writer(paths: list[str], tag: str) -> None:
    if os.fork() != 0:
        return
    try:  # die with the "VM" even if the process group is not signalled
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        _write_forever(paths, tag)
    finally:
        os._exit(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--agent", required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--hang", action="store_true")
    p.add_argument("--refuse", action="store_true")
    p.add_argument("--write", action="append", default=[])
    p.add_argument("--tag", default="vm")
    args = p.parse_args()
    for sub in ("etc", "run", "tmp"):
        os.makedirs(os.path.join(args.root, sub), exist_ok=True)
    print(f"testvmm: guest root {args.root}, agent socket {args.socket}", flush=True)
    dataplane = os.path.join(os.path.dirname(args.socket), "agent-dp.sock")
    if not os.path.lexists(dataplane):
        os.symlink(os.path.basename(args.socket), dataplane)
    if args.write:
        _start_writer(args.write, args.tag)
    if args.hang:
        while True:
            signal.pause()
    argv = [sys.executable, args.agent, "--socket", args.socket, "--root", args.root]
    if args.refuse:
        argv.append("--advertise-protocol-version=0")
    os.execv(sys.executable, argv)


if __name__ == "__main__":
    main()
