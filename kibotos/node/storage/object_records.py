"""Record writes the storage commands need beyond `PoolObjects`' open/release/delete.

`release_or_fence` ends a command's use of a block file whether or not a newer epoch
took it over meanwhile.

Both are fenced by the holder record, read again under the object's flock just before
the write: the metadata of an object belongs to its current holder (spec:
storage-pools-on-nfs, "Each object has three kinds of records"), so a node whose use
right was taken over meanwhile writes nothing.  They use `PoolObjects`' own record
writer (temp → fsync → rename, temporary names starting with this node's ID) and its
takeover decision, so there is one place for the paths and the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kibotos.node.storage.objects import Holder, PoolObjects, UseRightTakenOver


def _base(pool: PoolObjects, object_id: str) -> dict[str, Any]:
    return {"version": 1, "kind": pool.kind, "id": object_id, "pool_id": pool.pool_id}


def update_metadata(pool: PoolObjects, object_id: str, epoch: int,
                    changes: Mapping[str, Any], *, replace: bool = False) -> dict[str, Any]:
    """Merge `changes` into the metadata (a None value removes the key; `replace`
    starts from the identity only) while this node holds the object at `epoch`;
    returns what was written.  `UseRightTakenOver` when another holder came."""
    with pool.locked(object_id):
        holder = pool.holder(object_id)
        if holder != Holder(pool.node_id, epoch):
            raise UseRightTakenOver(
                f"{pool.label} {object_id} in pool {pool.pool_id}: the use right was taken "
                f"over (holder {holder.node_id if holder else 'none'} at epoch "
                f"{holder.epoch if holder else '-'}, this node holds epoch {epoch}); its "
                "metadata is not this node's to write",
                details={"reason": "use_right_taken_over"})
        meta = _base(pool, object_id) if replace else (
            pool.metadata(object_id) or _base(pool, object_id))
        for key, value in changes.items():
            if value is None:
                meta.pop(key, None)
            else:
                meta[key] = value
        meta.update(_base(pool, object_id))  # identity always matches the file name
        pool._write("metadata", object_id, meta)
        return meta


def claim(pool: PoolObjects, object_id: str, epoch: int) -> None:
    """Take the use right of an object this node is about to write into existence (a
    copy's target): the takeover table, then this node's holder record first.  No
    receipt wait: nobody writes a block file that is not there yet."""
    with pool.locked(object_id):
        if pool._decide(object_id, epoch) is not None:
            pool._write("holders", object_id, {"node_id": pool.node_id, "epoch": epoch})


def release_or_fence(pool: PoolObjects, object_id: str, epoch: int) -> Holder | None:
    """The command is done with the block file: release it cleanly; when a newer epoch
    took it over meanwhile, write the receipt its new holder awaits instead
    (`PoolObjects.fence`).  Returns that new holder, or None."""
    if pool.release(object_id, epoch, confirmed_on_disk=True):
        return None
    successor = pool.taken_over(object_id, epoch)
    if successor is not None:
        pool.fence(object_id, epoch, successor=successor)
    return successor
