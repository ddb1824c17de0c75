"""The console and VMM log tails an ended Instance leaves in
``<storage.root>/machine-logs/<instance_id>/`` (spec: node-and-vmm-processes, "Console
and VMM logs").

When an Instance ends, before its runtime directory goes, the last `TAIL_BYTES` of
``console.log`` and ``vmm.log`` are copied there, and the node writes one log line,
``instance machine exited``.  The directory has a total quota
(``[storage] machine_logs_limit``): past it, the oldest Instances' directories (by
modification time) are removed first, never the one just written.  A node that
restarts between the copy and the removal of the runtime directory finds the tails
already kept and neither copies nor logs them again, so each Instance gets exactly one
line.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kibotos.core import atomicfile

#: How much of each log an ended Instance leaves.
TAIL_BYTES = 256 * 1024
LOG_NAMES = ("console.log", "vmm.log")
#: Default total quota of ``machine-logs/`` (``[storage] machine_logs_limit``).
DEFAULT_LIMIT = 1 << 30


def _tail(src: Path, limit: int) -> bytes:
    with open(src, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - limit))
        return f.read()


def keep_tails(runtime_dir: Path, kept: Path, *, tail_bytes: int = TAIL_BYTES
               ) -> dict[str, int] | None:
    """Copy the log tails of `runtime_dir` into `kept`; the bytes kept per file, or None
    when `kept` already exists (a previous node process kept them)."""
    if kept.exists():
        return None
    sizes: dict[str, int] = {}
    staging = kept.with_name(f".{kept.name}-{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True, mode=0o750)
    for name in LOG_NAMES:
        src = runtime_dir / name
        if src.is_file():
            data = _tail(src, tail_bytes)
            atomicfile.write_bytes(staging / name, data, mode=0o640)
            sizes[name] = len(data)
    os.replace(staging, kept)
    atomicfile.fsync_dir(kept.parent)
    return sizes


def remove_staging(root: Path) -> list[str]:
    """Delete the staging directories of node processes that died in the middle of a
    copy (``.<instance_id>-<pid>.tmp``; this process's own are left alone)."""
    own = f"-{os.getpid()}.tmp"
    removed = []
    try:
        scanned = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for e in scanned:
        if e.name.startswith(".") and e.name.endswith(".tmp") and not e.name.endswith(own) \
                and e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path, ignore_errors=True)
            removed.append(e.name)
    return removed


def _size(directory: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total


def enforce_quota(root: Path, limit: int, *, keep: str | None = None) -> list[str]:
    """Remove the oldest Instance directories of `root` until the total is within
    `limit`; `keep` (the one just written) is never removed.  The removed names."""
    remove_staging(root)
    try:
        scanned = list(os.scandir(root))
    except FileNotFoundError:
        return []
    entries = [(e.stat().st_mtime, e.name, _size(Path(e.path))) for e in scanned
               if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")]
    total = sum(size for _, _, size in entries)
    removed = []
    for _, name, size in sorted(entries):
        if total <= limit:
            break
        if name == keep:
            continue
        shutil.rmtree(root / name, ignore_errors=True)
        total -= size
        removed.append(name)
    return removed
