"""The records of pool objects: paths, the flock, and reading and writing the three
records (metadata, holder, release receipt) of one kind of object in one pool.

`kibotos.node.storage.objects.PoolObjects` builds the takeover table, opening, releasing and
fencing on this.  Records are written temp → fsync → rename (`kibotos.core.atomicfile`,
temporary names starting with this node's ID, so a node sweeps only its own
leftovers in a shared pool) and reread from disk on every read, never cached: two hosts
never rewrite the same file, and decisions across hosts depend on no lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kibotos.core import atomicfile, ids
from kibotos.core.errors import Aborted, FailedPrecondition, InvalidArgument, Unavailable

RETAINED_LAYERS = "retained-layers"
VOLUMES = "volumes"
KINDS = (RETAINED_LAYERS, VOLUMES)
#: How long a takeover waits for the previous holder's release receipt (spec: 15 s).
RECEIPT_WAIT = 15.0
_LABELS = {RETAINED_LAYERS: "retained layer", VOLUMES: "volume"}
#: How long an operation waits for the object's flock before it fails retryably.  The
#: lock covers only record reads and writes here, so a long wait means another process
#: on this machine is stuck, or (NFS without ``nolock``) the lock of a previous node
#: process was not released yet or the server is in its lock recovery period.
LOCK_WAIT = 30.0
_LOCK_POLL = 0.05
#: The spec's wording for a lock that cannot be had (troubleshooting table).
_LOCK_HELD = {RETAINED_LAYERS: "retained layer lock is held",
              VOLUMES: "Volume operation lock is held"}


def now() -> str:
    """The timestamps in records (UTC, ISO 8601)."""
    return datetime.now(UTC).isoformat()


@dataclass(frozen=True)
class Holder:
    node_id: str
    epoch: int


#: Says why a pool cannot be used now, or None when it can (the node's pool monitor).
Availability = Callable[[], str | None]


class PoolRecords:
    """The records of the objects of one kind in one pool, as node `node_id` sees
    them.  `unavailable` is asked before every open and delete; without it (tools and
    tests that run no monitor) the pool counts as available."""

    def __init__(self, pool_id: str, pool_path: Path, kind: str, node_id: str, *,
                 receipt_wait: float = RECEIPT_WAIT,
                 unavailable: Availability | None = None) -> None:
        if kind not in KINDS:
            raise InvalidArgument(f"unknown pool object kind {kind!r}")
        self.pool_id = pool_id
        self.root = pool_path / kind
        self.kind = kind
        self.label = _LABELS[kind]
        self.node_id = node_id
        self.receipt_wait = receipt_wait
        self.unavailable = unavailable
        self.lock_wait = LOCK_WAIT

    # ------------------------------------------------------------------ paths

    def _check(self, object_id: str) -> str:
        return ids.check_object_id(object_id, f"{self.label} ID")

    def data_path(self, object_id: str) -> Path:
        return self.root / "data" / f"{self._check(object_id)}.ext4"

    def _record(self, sub: str, object_id: str) -> Path:
        return self.root / sub / f"{self._check(object_id)}.json"

    def _what(self, object_id: str) -> str:
        return f"{self.label} {object_id} in pool {self.pool_id}"

    def check_available(self) -> None:
        """Refuse when the pool monitor says the pool cannot be used (spec wording
        ``storage pool is unavailable``); retryable, the pool may come back."""
        reason = self.unavailable() if self.unavailable is not None else None
        if reason is not None:
            raise Unavailable(f"storage pool is unavailable: pool {self.pool_id}: {reason}",
                              details={"reason": "pool_unavailable",
                                       "pool_id": self.pool_id})

    async def settle_names(self, object_id: str, epoch: int) -> None:
        """Bring the object's files to their current names before anything reads them
        by name (expand, copy, export).  Nothing to do here; `NamedPoolObjects` (what
        the node runs) renames the SHA-256 names of versions before v0.1.0."""

    @contextlib.contextmanager
    def locked(self, object_id: str) -> Iterator[None]:
        """flock on ``locks/<id>.lock``: one operation on an object at a time here."""
        lock = self.root / "locks" / f"{self._check(object_id)}.lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            # The layout `prepare` made at start is gone: most likely the pool was
            # unmounted since.  Creating it here would write onto the wrong disk.
            raise Unavailable(
                f"storage pool is unavailable: pool {self.pool_id}: {lock.parent} is "
                "missing (the pool layout the node prepared at start is gone; is the pool "
                "still mounted?)", details={"reason": "pool_unavailable",
                                            "pool_id": self.pool_id}) from None
        try:
            self._flock(fd, object_id, lock)
            yield
        finally:
            os.close(fd)

    def _flock(self, fd: int, object_id: str, lock: Path) -> None:
        """LOCK_EX within `lock_wait` seconds (monotonic), else `Aborted` with the
        spec's message: a retryable conflict rather than a command that never returns."""
        deadline = time.monotonic() + self.lock_wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as exc:
                busy = exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
                if busy and time.monotonic() < deadline:
                    time.sleep(_LOCK_POLL)
                    continue
                why = (f"another operation has held {lock} for {self.lock_wait:g} s"
                       if busy else f"flock {lock}: {exc.strerror or exc}")
                raise Aborted(
                    f"{_LOCK_HELD[self.kind]}: {self._what(object_id)}: {why} (on NFS: the "
                    "lock of a previous node process was not released yet, or the server "
                    "is in its lock recovery period); retry later",
                    details={"reason": "object_lock_held", "pool_id": self.pool_id,
                             "object_id": object_id}) from None

    # ------------------------------------------------------------------ records

    def _read(self, sub: str, object_id: str) -> dict[str, Any] | None:
        path = self._record(sub, object_id)
        what = self._what(object_id)
        return atomicfile.read_json_object_if_present(
            path, lambda exc: f"{what}: unreadable record {path}: {exc}",
            f"{what}: record {path} is not an object")

    def _write(self, sub: str, object_id: str, value: Mapping[str, Any]) -> None:
        atomicfile.write_json(self._record(sub, object_id), dict(value), prefix=self.node_id)

    def holder(self, object_id: str) -> Holder | None:
        rec = self._read("holders", object_id)
        if rec is None:
            return None
        node, epoch = rec.get("node_id"), rec.get("epoch")
        if not isinstance(node, str) or not isinstance(epoch, int):
            raise FailedPrecondition(f"{self._what(object_id)}: holder record lacks "
                                     "node_id or epoch")
        return Holder(node, epoch)

    def release_receipt(self, object_id: str) -> Holder | None:
        rec = self._read("releases", object_id)
        if rec is None or not isinstance(rec.get("node_id"), str) or \
                not isinstance(rec.get("epoch"), int):
            return None
        return Holder(rec["node_id"], rec["epoch"])

    def metadata(self, object_id: str) -> dict[str, Any] | None:
        """The metadata record; its identity must match the file name (spec)."""
        rec = self._read("metadata", object_id)
        if rec is not None and (rec.get("id") != object_id or rec.get("kind") != self.kind):
            raise FailedPrecondition(
                f"{self._what(object_id)}: metadata names {rec.get('kind')} "
                f"{rec.get('id')!r}, not this object: refusing to use it")
        return rec

    def held_by_me(self) -> list[str]:
        """IDs whose holder record names this node (read at start for the report)."""
        out = []
        try:
            names = sorted(os.listdir(self.root / "holders"))
        except OSError:
            return []
        for name in names:
            if name.startswith(".") or not name.endswith(".json"):
                continue
            object_id = name[:-5]
            try:
                holder = self.holder(object_id)
            except (FailedPrecondition, InvalidArgument):
                continue
            if holder is not None and holder.node_id == self.node_id:
                out.append(object_id)
        return out
