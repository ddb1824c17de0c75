#!/usr/bin/env python3
"""What the crash-safe pool records cost, beside the disk's own durable write.

    .venv/bin/python bench/pool.py [--dir DIR] [--records 300] [--takeovers 40] [--json]

1. **4 KiB record write**: one 4096-byte record replaced the way every pool record is
   (`kibotos.core.atomicfile.write_bytes`: temporary file beside the target, write, fsync,
   rename, fsync of the directory), timed per write.  Beside it, on the same disk, a
   plain durable write: 4096 bytes written in place into an open file, then fsync.
   The ratio of the two is what temp + rename + directory fsync add.
2. **Takeover without a wait**: `PoolObjects.open` of a Volume by node-b at a newer
   epoch after node-a released it normally (so its release counts as the receipt and
   nothing waits): the takeover table, holder record, reads of receipt and metadata,
   the attach in the metadata, under the object's flock.  node-a and node-b take
   turns, each releasing after its open, so every open is a takeover.

``--dir`` is where the pool lives (default: a fresh directory under /var/tmp, removed
after); point it at an NFS mount to see what a shared pool costs there.  Records and
rounds are interleaved (a record write, then a plain write) so both see the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import trio
from benchlib import percentile

from kibotos.core import atomicfile
from kibotos.node.storage.objects import VOLUMES, PoolObjects
from kibotos.node.storage.pools.dirs import prepare_pool_dirs

RECORD = 4096
MIB = 1 << 20


def record_writes(pool: Path, count: int) -> tuple[list[float], list[float]]:
    """(atomic record write, plain write+fsync) seconds, interleaved."""
    target = pool / VOLUMES / "holders" / "bench-record.json"
    plain_path = pool / VOLUMES / "holders" / "bench-plain.bin"
    empty = json.dumps({"node_id": "node-bench", "epoch": 1, "pad": ""})
    data = json.dumps({"node_id": "node-bench", "epoch": 1,
                       "pad": "x" * (RECORD - len(empty))}).encode()
    assert len(data) == RECORD
    atomic, plain = [], []
    fd = os.open(plain_path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            atomicfile.write_bytes(target, data, prefix="node-bench")
            atomic.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            os.pwrite(fd, data, 0)
            os.fsync(fd)
            plain.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
    target.unlink(missing_ok=True)
    plain_path.unlink(missing_ok=True)
    return atomic, plain


async def takeovers(pool: Path, count: int) -> list[float]:
    nodes = [PoolObjects("pool-bench", pool, VOLUMES, "node-a", receipt_wait=15),
             PoolObjects("pool-bench", pool, VOLUMES, "node-b", receipt_wait=15)]
    await nodes[0].open("vol-bench", 1, create_capacity=16 * MIB)
    assert nodes[0].release("vol-bench", 1, confirmed_on_disk=True)
    times = []
    for epoch in range(2, count + 2):
        objs = nodes[(epoch - 1) % 2]
        t0 = time.perf_counter()
        opened = await objs.open("vol-bench", epoch)
        times.append(time.perf_counter() - t0)
        if opened.handoff_clean is not True:
            raise SystemExit(f"takeover at epoch {epoch} was not clean: {opened}")
        assert objs.release("vol-bench", epoch, confirmed_on_disk=True)
    return times


def summary(values: list[float]) -> dict[str, float]:
    return {"p50_ms": percentile(values, 0.5) * 1000, "p99_ms": percentile(values, 0.99) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--records", type=int, default=300)
    parser.add_argument("--takeovers", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    own = args.dir is None
    base = Path(tempfile.mkdtemp(prefix="kibotos-bench-pool-", dir="/var/tmp")) \
        if own else args.dir
    try:
        pool = base / "pool"
        pool.mkdir(parents=True, exist_ok=True)
        prepare_pool_dirs("pool-bench", pool)
        atomic, plain = record_writes(pool, args.records)
        take = trio.run(takeovers, pool, args.takeovers)
    finally:
        if own:
            shutil.rmtree(base, ignore_errors=True)
        else:
            shutil.rmtree(base / "pool", ignore_errors=True)
    a, p, t = summary(atomic), summary(plain), summary(take)
    result = {"dir": str(base), "records": args.records, "takeovers": args.takeovers,
              "record_write": a, "plain_write_fsync": p,
              "ratio": {"p50": a["p50_ms"] / p["p50_ms"], "p99": a["p99_ms"] / p["p99_ms"]},
              "takeover_no_wait": t}
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    print(f"pool on {base} ({args.records} writes, {args.takeovers} takeovers)")
    print(f"{'':34} {'p50':>9} {'p99':>9}")
    print(f"{'4 KiB record (temp+fsync+rename)':34} {a['p50_ms']:8.2f}ms {a['p99_ms']:8.2f}ms")
    print(f"{'4 KiB plain write+fsync':34} {p['p50_ms']:8.2f}ms {p['p99_ms']:8.2f}ms")
    print(f"{'ratio record / plain':34} {result['ratio']['p50']:8.2f}x "
          f"{result['ratio']['p99']:8.2f}x")
    print(f"{'takeover, no receipt wait':34} {t['p50_ms']:8.2f}ms {t['p99_ms']:8.2f}ms")


if __name__ == "__main__":
    main()
