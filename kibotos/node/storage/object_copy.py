"""``object.copy``: a Volume or retained layer copied into another pool on this node.

The node must reach both pools (ctrl sends the command only to such a node; spec:
"Moving objects between pools", ``failed_precondition`` when none connects to both).
The source is opened at the command's epoch (the takeover table applies, so nobody
writes it while it is read) and released after; in the target pool the node takes the
use right at the same epoch (its holder record first), copies the block file sparsely
(only the ranges ``SEEK_DATA``/``SEEK_HOLE`` report as data, and within them zero
pieces stay holes) into a temporary name that starts with this node's ID, hands it to
the VMM identity, fsyncs, renames, then writes the metadata (the source's, with the
target pool and ``copied_from``) and the release receipt, so any node attached to the
target pool can open it at that epoch or newer.  The source stays until ctrl deletes it.
A newer epoch of the source seen by the caller's 5-second holder check cancels the copy
(between pieces: the copy in the worker thread finishes its file first); the source's
receipt is then written for the new holder and the target gets no metadata.

Idempotent: a target whose metadata says it was copied from the same pool at the same
epoch and released is the answer; an unfinished copy is made again from the start.
"""

from __future__ import annotations

import functools
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import trio

from kibotos.core import atomicfile, failpoints
from kibotos.core.errors import AlreadyExists, NotFound
from kibotos.node.storage.object_records import claim, release_or_fence, update_metadata
from kibotos.node.storage.objects import PoolObjects
from kibotos.node.storage.pools.dirs import hand_block_file
from kibotos.transfer_archive import data_ranges

_CHUNK = 1 << 20
#: Metadata keys that describe one holder's use, not the object: not copied.
_PER_HOLDER = ("state", "holder", "epoch", "attached_at", "released_at", "handoff_clean",
               "confirmed_on_disk", "released_cleanly")


def sparse_copy(src: Path, target: Path, *, prefix: str, kind: str) -> int:
    """Copy block file `src` to `target` (atomically: temp beside it, VMM identity,
    fsync, rename, directory fsync) keeping holes; returns the bytes of data read."""
    tmp = atomicfile.temp_name(target, prefix)
    copied = 0
    fd_in = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd_in).st_size
        fd_out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            for start, length in data_ranges(fd_in, size):
                end = start + length
                for offset in range(start, end, _CHUNK):
                    data = os.pread(fd_in, min(_CHUNK, end - offset), offset)
                    os.lseek(fd_out, offset, os.SEEK_SET)
                    atomicfile.write_sparse(fd_out, data)
                    copied += len(data)
            os.ftruncate(fd_out, size)
            os.fsync(fd_out)
        finally:
            os.close(fd_out)
        hand_block_file(tmp, kind)
        failpoints.hit("node.copy.before-rename")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd_in)
    atomicfile.fsync_dir(target.parent)
    return copied


def _done(dst: PoolObjects, object_id: str, from_pool: str, epoch: int) -> bool:
    """Whether the target already is this copy; `AlreadyExists` when the target pool
    has another object under this ID."""
    meta = dst.metadata(object_id)
    if meta is None:
        return False
    source = meta.get("copied_from")
    if not isinstance(source, dict) or source.get("pool_id") != from_pool:
        raise AlreadyExists(f"{dst.label} {object_id} already exists in pool {dst.pool_id} "
                            f"(not a copy from pool {from_pool})")
    return source.get("epoch") == epoch and meta.get("state") == "released" and \
        dst.data_path(object_id).is_file()


async def copy_object(src: PoolObjects, dst: PoolObjects, object_id: str, epoch: int
                      ) -> bool:
    """Copy `object_id` from `src` to `dst` (see the module docstring); False when the
    target already was this copy."""
    run = trio.to_thread.run_sync
    if await run(_done, dst, object_id, src.pool_id, epoch):
        return False
    await src.settle_names(object_id, epoch)
    meta = await run(src.metadata, object_id)
    if meta is None or not await run(src.data_path(object_id).is_file):
        raise NotFound(f"{src.label} {object_id} does not exist in pool {src.pool_id}")
    opened = await src.open(object_id, epoch)
    try:
        await run(claim, dst, object_id, epoch)
        target = dst.data_path(object_id)
        copied = await run(functools.partial(sparse_copy, opened.path, target,
                                             prefix=dst.node_id, kind=dst.kind))
        failpoints.hit("node.copy.after-data")
        size = (await run(os.stat, target)).st_size
        now = datetime.now(UTC).isoformat()
        record: dict[str, Any] = {k: v for k, v in meta.items() if k not in _PER_HOLDER}
        record.update(pool_id=dst.pool_id, capacity_bytes=size, state="attached",
                      holder=dst.node_id, epoch=epoch, attached_at=now,
                      copied_from={"pool_id": src.pool_id, "epoch": epoch, "at": now,
                                   "data_bytes": copied})
        await run(functools.partial(update_metadata, dst, object_id, epoch, record,
                                    replace=True))
        await run(functools.partial(dst.release, object_id, epoch, confirmed_on_disk=True))
    finally:
        with trio.CancelScope(shield=True):
            await run(release_or_fence, src, object_id, epoch)
    return True
