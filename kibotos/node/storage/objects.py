"""Block-file objects in a storage pool, as far as an Instance needs them today.

Layout (spec: storage-pools-on-nfs, "Directory layout"), per kind (``retained-layers``
or ``volumes``)::

    <pool>/<kind>/data/<id>.ext4        sparse ext4 block file, length = capacity
    <pool>/<kind>/metadata/<id>.json    identity, capacity, lower, lifecycle, released_cleanly
    <pool>/<kind>/holders/<id>.json     {node_id, epoch}: who holds the use right
    <pool>/<kind>/releases/<id>.json    {node_id, epoch}: the receipt of a holder that
                                        stopped writing
    <pool>/<kind>/locks/<id>.lock       flock, mutual exclusion on this machine only

Every record is written temp → fsync → rename (`kibotos.core.atomicfile`, temporary names
starting with this node's ID) and reread on every read.  Before opening a block file
the node applies the spec's takeover table ("Epochs and takeover"): a newer epoch in the
holder record refuses (the use right was taken over; retrying cannot help), the same
epoch held by this node opens directly, an older epoch or no record is taken over by
writing this node's holder record first.  When taking over from a holder that did not
release, the node waits up to 15 s (monotonic) for its release receipt and records
``released_cleanly=false`` when none came.  A holder that finds a newer epoch in the
record (`kibotos.node.storage.holder_watch`, every 5 s) flushes the block file and writes its
receipt with `fence`, leaving the metadata to the new holder.

Crash safety: each record is whole or absent.  A new object's metadata is written
before its block file gets its name, so a block file never exists without metadata; a
takeover interrupted after the holder record is finished by the retry at the same
epoch, which still waits for the previous holder that the metadata names.

The directories are the ones `kibotos.node.storage.pools.startup.prepare` made at start (owner
and modes of the spec); this module never creates them, so a pool directory that lost
its layout (unmounted since) fails instead of filling the root disk.  New block files
are handed to the VMM identity (``root:kibotos-vmm`` 0660,
`kibotos.node.storage.pools.dirs.hand_block_file`) before they get their name.  An object in a
pool the availability monitor reports unavailable is refused (``Unavailable``,
retryable: the pool may come back) before anything is written.

Paths, the flock and the record reads and writes are `kibotos.node.storage.pool_records`
(`PoolRecords`, the base class).  Not here yet (issue 4): expansion, transfer, legacy
names.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from kibotos.core import atomicfile, failpoints
from kibotos.core.errors import FailedPrecondition
from kibotos.node.storage.pool_records import (
    KINDS,
    RECEIPT_WAIT,
    RETAINED_LAYERS,
    VOLUMES,
    Availability,
    Holder,
    PoolRecords,
)
from kibotos.node.storage.pool_records import now as _now
from kibotos.node.storage.pools.dirs import hand_block_file
from kibotos.platform.images import create_ext4

__all__ = ["KINDS", "RECEIPT_WAIT", "RETAINED_LAYERS", "VOLUMES", "Availability",
           "Holder", "Opened", "PoolObjects", "PoolRecords", "UseRightTakenOver"]
_RECEIPT_POLL = 0.2


@dataclass(frozen=True)
class Opened:
    """The outcome of `PoolObjects.open`: the block file, and whether the handoff to
    this node was clean (None when no handoff happened: a new object, a retry or an
    adoption; True also when this node reopens what it released itself)."""

    path: Path
    handoff_clean: bool | None
    created: bool


class UseRightTakenOver(FailedPrecondition):
    """A newer epoch holds the object: retrying will not succeed."""



class PoolObjects(PoolRecords):
    """The objects of one kind in one pool, handled by node `node_id`: the takeover
    table, open, release, fence and delete (records and paths: `PoolRecords`)."""

    # ------------------------------------------------------------------ open

    def _decide(self, object_id: str, epoch: int) -> Holder | None:
        """The takeover table; returns the previous holder to take over from, or None
        when the object opens directly (same epoch, this node).  Raises when refused."""
        holder = self.holder(object_id)
        what = self._what(object_id)
        if holder is not None and holder.epoch > epoch:
            raise UseRightTakenOver(
                f"{what}: the use right was taken over (node {holder.node_id} holds epoch "
                f"{holder.epoch}, this command carries {epoch}); retrying will not succeed",
                details={"reason": "use_right_taken_over", "holder_epoch": holder.epoch})
        if holder is not None and holder.epoch == epoch:
            if holder.node_id == self.node_id:
                return None
            raise UseRightTakenOver(
                f"{what}: node {holder.node_id} already holds epoch {epoch}; this node "
                "does not open it", details={"reason": "use_right_taken_over",
                                             "holder_epoch": holder.epoch})
        return holder or Holder("", -1)

    def _released(self, object_id: str, previous: Holder) -> bool:
        """Whether `previous` stopped writing: its receipt, or its clean release."""
        if previous.epoch < 0:
            return True
        receipt = self.release_receipt(object_id)
        if receipt == previous:
            return True
        meta = self.metadata(object_id)
        return bool(meta and meta.get("state") == "released"
                    and meta.get("released_cleanly") is True
                    and meta.get("epoch") == previous.epoch
                    and meta.get("holder") == previous.node_id)

    def _create(self, object_id: str, capacity: int, lower: Mapping[str, Any] | None) -> None:
        """Metadata first, then the block file under its name: an interrupted create
        leaves metadata without data (the retry makes the data; a delete removes it),
        never a block file nobody describes."""
        target = self.data_path(object_id)
        tmp = atomicfile.temp_name(target, self.node_id)
        try:
            create_ext4(tmp, capacity, label="kibotos-rw" if self.kind == RETAINED_LAYERS
                        else "")
            hand_block_file(tmp, self.kind)  # root:kibotos-vmm 0660 before it has a name
            self._flush_file(tmp)
            self._write("metadata", object_id, {
                "version": 1, "kind": self.kind, "id": object_id, "pool_id": self.pool_id,
                "capacity_bytes": capacity, "lower": dict(lower or {}), "state": "created",
                "created_at": _now(), "holder": self.node_id, "epoch": None,
                "released_cleanly": True})
            failpoints.hit("objects.create.after-metadata")
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        atomicfile.fsync_dir(target.parent)
        failpoints.hit("objects.create.after-data")

    @staticmethod
    def _flush_file(path: Path) -> None:
        atomicfile.fsync_path(path, os.O_CLOEXEC)

    def _attach(self, object_id: str, epoch: int, clean: bool | None) -> None:
        meta = self.metadata(object_id) or {"version": 1, "kind": self.kind, "id": object_id,
                                            "pool_id": self.pool_id}
        meta.update(state="attached", holder=self.node_id, epoch=epoch, attached_at=_now())
        if clean is not None:
            meta["released_cleanly"] = clean
            meta["handoff_clean"] = clean
        self._write("metadata", object_id, meta)

    async def open(self, object_id: str, epoch: int, *, create_capacity: int | None = None,
                   lower: Mapping[str, Any] | None = None) -> Opened:
        """Take the use right at `epoch` per the takeover table and return the block
        file; with `create_capacity`, make a missing object first (truncate + mkfs).
        The three steps are public so that a Workspace's objects are all taken before
        their receipts are awaited together (`kibotos.node.instances.lifecycle`)."""
        previous = await self.take(object_id, epoch, may_create=create_capacity is not None)
        clean = await self.wait_released(object_id, previous,
                                         trio.current_time() + self.receipt_wait)
        return await self.finish_open(object_id, epoch, clean, create_capacity=create_capacity,
                                      lower=lower)

    async def take(self, object_id: str, epoch: int, *, may_create: bool) -> Holder | None:
        """Step 1: the takeover table; writes this node's holder record when taking
        over.  Returns the previous holder still owed a receipt wait, if any."""
        self._check(object_id)
        self.check_available()
        return await trio.to_thread.run_sync(self._take, object_id, epoch, may_create)

    async def wait_released(self, object_id: str, previous: Holder | None, deadline: float
                            ) -> bool | None:
        """Step 2: until `deadline` (trio clock, monotonic), whether `previous` stopped
        writing (its receipt or clean release); None when nobody held it before."""
        if previous is None or previous.epoch < 0:
            return None
        return await self._await_receipt(object_id, previous, deadline)

    async def finish_open(self, object_id: str, epoch: int, clean: bool | None, *,
                          create_capacity: int | None = None,
                          lower: Mapping[str, Any] | None = None) -> Opened:
        """Step 3: make a missing object, record the attach and the handoff."""
        return await trio.to_thread.run_sync(self._finish_open, object_id, epoch, clean,
                                             create_capacity, lower)

    def _take(self, object_id: str, epoch: int, may_create: bool) -> Holder | None:
        with self.locked(object_id):
            previous = self._decide(object_id, epoch)
            if not may_create and not self.data_path(object_id).is_file():
                raise FailedPrecondition(f"{self._what(object_id)} does not exist "
                                         f"({self.data_path(object_id)} is missing)")
            if previous is not None:  # take over: holder record first, then open
                self._write("holders", object_id, {"node_id": self.node_id, "epoch": epoch,
                                                   "at": _now()})
                failpoints.hit("objects.take.after-holder")
                return previous
            return self._unfinished_takeover(object_id, epoch)

    def _unfinished_takeover(self, object_id: str, epoch: int) -> Holder | None:
        """Our holder record at `epoch`, but the metadata still names an older attach:
        a takeover was interrupted (crash) before it opened.  Its previous holder is
        still owed the receipt wait."""
        meta = self.metadata(object_id)
        if meta is None:
            return None
        old_epoch, old_node = meta.get("epoch"), meta.get("holder")
        if isinstance(old_epoch, int) and old_epoch < epoch and isinstance(old_node, str):
            return Holder(old_node, old_epoch)
        return None

    async def _await_receipt(self, object_id: str, previous: Holder, deadline: float
                             ) -> bool:
        with trio.move_on_at(deadline):
            while True:
                if await trio.to_thread.run_sync(self._released, object_id, previous):
                    return True
                await trio.sleep(_RECEIPT_POLL)
        return False

    def _finish_open(self, object_id: str, epoch: int, clean: bool | None,
                     create_capacity: int | None, lower: Mapping[str, Any] | None) -> Opened:
        with self.locked(object_id):
            if self.holder(object_id) != Holder(self.node_id, epoch):
                self._decide(object_id, epoch)  # raises if a newer epoch came meanwhile
                raise FailedPrecondition(f"{self._what(object_id)}: the holder record "
                                         "changed while it was being opened; retry")
            path = self.data_path(object_id)
            created = False
            if not path.is_file():
                if create_capacity is None:
                    raise FailedPrecondition(f"{self._what(object_id)} does not exist "
                                             f"({path} is missing)")
                self._create(object_id, create_capacity, lower)
                created = True
            if clean is None and self._reopened_after_release(object_id, epoch):
                clean = True
            self._drop_own_receipt(object_id, epoch)
            self._attach(object_id, epoch, clean)
            return Opened(path, clean, created)

    def _reopened_after_release(self, object_id: str, epoch: int) -> bool:
        """This node opens again, at the same epoch, what it released cleanly itself
        (a stop and a start on the same node): the use right went back and came out
        again, a clean handoff.  A retry or an adoption finds it still attached."""
        meta = self.metadata(object_id)
        return bool(meta and meta.get("state") == "released"
                    and meta.get("holder") == self.node_id and meta.get("epoch") == epoch
                    and meta.get("released_cleanly") is True)

    def _drop_own_receipt(self, object_id: str, epoch: int) -> None:
        """Reopening at an epoch this node already released: that receipt no longer
        tells the truth (it would let a successor open without waiting while this
        node writes), so it goes before the block file is opened again."""
        if self.release_receipt(object_id) == Holder(self.node_id, epoch):
            path = self._record("releases", object_id)
            path.unlink(missing_ok=True)
            atomicfile.fsync_dir(path.parent)

    # ------------------------------------------------------------------ release, delete

    def release(self, object_id: str, epoch: int, *, confirmed_on_disk: bool) -> bool:
        """The block file is closed: flush it (on NFS the client may still hold dirty
        pages of the VMM's writes), record the clean release and the receipt, keep the
        holder record.  Returns False (writing nothing) when another holder took over."""
        with self.locked(object_id):
            if self.holder(object_id) != Holder(self.node_id, epoch):
                return False
            data = self.data_path(object_id)
            if data.is_file():
                self._flush_file(data)
            meta = self.metadata(object_id) or {"version": 1, "kind": self.kind,
                                                "id": object_id, "pool_id": self.pool_id}
            meta.update(state="released", holder=self.node_id, epoch=epoch,
                        released_cleanly=True, confirmed_on_disk=confirmed_on_disk,
                        released_at=_now())
            self._write("metadata", object_id, meta)
            failpoints.hit("objects.release.after-metadata")
            self._write("releases", object_id, {"node_id": self.node_id, "epoch": epoch,
                                                "at": _now()})
            return True

    # ------------------------------------------------------------------ fencing

    def taken_over(self, object_id: str, epoch: int) -> Holder | None:
        """The holder that replaced this node's use right at `epoch`, or None while it
        is still ours (no record, or an epoch not newer).  Reread from disk every time."""
        holder = self.holder(object_id)
        if holder is not None and (holder.epoch > epoch or (
                holder.epoch == epoch and holder.node_id != self.node_id)):
            return holder
        return None

    def fence(self, object_id: str, epoch: int, *, successor: Holder) -> bool:
        """This node stopped writing the object it held at `epoch` (its VMM is gone):
        flush the block file, then write the release receipt the successor awaits.
        The metadata is the successor's now and is left alone; a receipt of a newer
        epoch is never replaced.  Returns whether a receipt was written."""
        path = self.data_path(object_id)
        if path.is_file():
            self._flush_file(path)
        with self.locked(object_id):
            current = self.release_receipt(object_id)
            if current is not None and current.epoch >= epoch:
                return current == Holder(self.node_id, epoch)
            failpoints.hit("objects.fence.before-receipt")
            self._write("releases", object_id, {
                "node_id": self.node_id, "epoch": epoch, "at": _now(),
                "reason": "taken_over", "successor": {"node_id": successor.node_id,
                                                      "epoch": successor.epoch}})
            return True

    def delete(self, object_id: str, epoch: int) -> bool:
        """Delete the block file and its records (metadata last, so an interrupted
        delete is finished by a retry).  Refused when a newer epoch holds it, or when
        the pool is unavailable."""
        self.check_available()
        with self.locked(object_id):
            holder = self.holder(object_id)
            if holder is not None and holder.epoch > epoch:
                raise UseRightTakenOver(
                    f"{self._what(object_id)}: the use right was taken over (node "
                    f"{holder.node_id} holds epoch {holder.epoch}, this command carries "
                    f"{epoch}); not deleted", details={"reason": "use_right_taken_over"})
            existed = False
            for path in (self.data_path(object_id), self._record("holders", object_id),
                         self._record("releases", object_id),
                         self._record("metadata", object_id)):
                try:
                    path.unlink()
                    existed = True
                except FileNotFoundError:
                    continue
                atomicfile.fsync_dir(path.parent)
            (self.root / "locks" / f"{object_id}.lock").unlink(missing_ok=True)
            return existed
