"""The node's attachment records: which of its Instances has which pool object open.

Spec (storage-pools-on-nfs, "Directory layout"): the pool records only facts about the
objects themselves; attachments are recorded in a local directory of the node that
attaches them, and other nodes never read it::

    <storage.root>/runtime/storage-pools/<pool-id>/<kind>/<object-id>.json
        {"instance_id": ..., "epoch": ..., "attached_at": ...}

``<kind>`` is ``retained-layers`` or ``volumes``, as in the pool.  The invariant is
"every object an Instance of this node has open has a record naming it"; a record may
outlive the open for a moment, never the other way round:

* the record is written (`kibotos.core.atomicfile`: temp → fsync → rename, a local temporary
  name without a node ID) *before* the object is taken over and opened for the
  Instance (`kibotos.node.instances.lifecycle.Launcher.open_objects`, and again by adoption's
  reattach), and removed only *after* its release or fence is recorded in the pool;
* an open that fails removes the records of the objects it did not open; a record is
  only ever removed by the Instance it names (`remove`), so one Instance's release
  cannot drop another's record.

What a record means at start (`reconcile`, run before the pool monitor and adoption
look at anything, `kibotos.node.instances.setup`), compared with the Instance record
``runtime/instances/<id>/instance.json`` it names:

==========================================  =============================================
the Instance has no directory, or its        deleted: the crash came between recording
record says its objects were released        the release (or fence) and removing the
(``released``, or STOPPED / DESTROYED)       record; nobody has the object open
the Instance record lists the object in      kept: adoption or the repeated stop deals
``held`` (not released)                      with the Instance
the Instance is live but does not list it    deleted: the crash came between writing the
                                             record and the Instance record catching up;
                                             the manager persists ``held`` before any
                                             VMM starts, so no process has it open; a
                                             new boot writes it again before opening
the Instance record is unreadable            kept (ownership unclear; the manager and
                                             check-maintenance report the record)
==========================================  =============================================

And the other way: an object a live Instance record lists in ``held`` without a record
(state left by a node before these records existed) gets one, so the records alone
answer "is this object attached here" from then on: the SHA-256 rename at start
(`kibotos.node.storage.pools.legacy_names`) and check-maintenance ask them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kibotos.core import atomicfile, ids
from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.core.logs import EventLogger
from kibotos.node.records import instance_records as records

log = EventLogger()

KINDS = ("retained-layers", "volumes")
#: Instance states whose objects were released (the Instance ended).
_ENDED = ("STOPPED", "DESTROYED")
Key = tuple[str, str, str]  # (pool ID, kind, object ID)


@dataclass(frozen=True)
class Attachment:
    """One record: `instance_id` has the object open at `epoch` since `attached_at`."""

    pool_id: str
    kind: str
    object_id: str
    instance_id: str
    epoch: int
    attached_at: str

    @property
    def key(self) -> Key:
        return (self.pool_id, self.kind, self.object_id)


@dataclass
class Scan:
    """Every record under the directory; `unreadable` maps the key of a record that
    cannot be read to why (it still counts as attached: ownership is unclear)."""

    found: list[Attachment] = field(default_factory=list)
    unreadable: dict[Key, str] = field(default_factory=dict)


@dataclass
class Reconciled:
    """What `reconcile` did at start."""

    deleted: list[Attachment] = field(default_factory=list)
    written: list[Attachment] = field(default_factory=list)
    kept: list[Attachment] = field(default_factory=list)


def _now() -> str:
    return datetime.now(UTC).isoformat()


class Attachments:
    """The records under ``<storage_root>/runtime/storage-pools``.  Every method is
    blocking (call it from a worker thread)."""

    def __init__(self, storage_root: Path) -> None:
        self.storage_root = storage_root
        self.root = storage_root / "runtime" / "storage-pools"

    # ------------------------------------------------------------------ one record

    def path(self, pool_id: str, kind: str, object_id: str) -> Path:
        ids.check_pool_id(pool_id)
        if kind not in KINDS:
            raise InvalidArgument(f"unknown pool object kind {kind!r}")
        return self.root / pool_id / kind / f"{ids.check_object_id(object_id)}.json"

    def _ensure_dir(self, directory: Path) -> None:
        """Create the missing levels (0700) and make each new entry durable."""
        missing = []
        level = directory
        while not level.is_dir():
            missing.append(level)
            level = level.parent
        for new in reversed(missing):
            try:
                new.mkdir(mode=0o700)
            except FileExistsError:
                continue
            atomicfile.fsync_dir(new.parent)

    def record(self, pool_id: str, kind: str, object_id: str, *, instance_id: str,
               epoch: int) -> Attachment:
        """Write the record: `instance_id` opens the object at `epoch`.  The same record
        already there (a retry, an adoption) is kept as it is, `attached_at` included."""
        path = self.path(pool_id, kind, object_id)
        ids.check_object_id(instance_id, "instance ID")
        try:
            same = self.read(pool_id, kind, object_id)
        except FailedPrecondition:
            same = None  # unreadable: replaced by a whole one
        if same is not None and (same.instance_id, same.epoch) == (instance_id, epoch):
            return same
        self._ensure_dir(path.parent)
        att = Attachment(pool_id, kind, object_id, instance_id, int(epoch), _now())
        atomicfile.write_json(path, {"instance_id": instance_id, "epoch": att.epoch,
                                     "attached_at": att.attached_at}, mode=0o600)
        return att

    def read(self, pool_id: str, kind: str, object_id: str) -> Attachment | None:
        """The record, reread from disk; `FailedPrecondition` when it is unreadable."""
        path = self.path(pool_id, kind, object_id)
        lacks = f"attachment record {path} lacks instance_id or epoch"
        value = atomicfile.read_json_object_if_present(
            path, lambda exc: f"unreadable attachment record {path}: {exc}", lacks)
        if value is None:
            return None
        if not isinstance(value.get("instance_id"), str) \
                or not isinstance(value.get("epoch"), int):
            raise FailedPrecondition(lacks)
        return Attachment(pool_id, kind, object_id, value["instance_id"], value["epoch"],
                          str(value.get("attached_at") or ""))

    def remove(self, pool_id: str, kind: str, object_id: str, *, instance_id: str) -> bool:
        """Remove the record if it names `instance_id` (another Instance's record, or
        an unreadable one, is left alone); whether it was removed."""
        try:
            att = self.read(pool_id, kind, object_id)
        except FailedPrecondition as exc:
            log.warning("attachment record left: unreadable", instance=instance_id,
                        pool=pool_id, kind=kind, object=object_id, error=exc.message)
            return False
        if att is None or att.instance_id != instance_id:
            return False
        path = self.path(pool_id, kind, object_id)
        path.unlink(missing_ok=True)
        atomicfile.fsync_dir(path.parent)
        return True

    # ------------------------------------------------------------------ all records

    def scan(self) -> Scan:
        """Every record; dot-files (temporary files of interrupted writes) and names
        that are not object IDs are not records."""
        out = Scan()
        try:
            pools = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return out
        for pool_id in pools:
            for kind in KINDS:
                try:
                    names = sorted(os.listdir(self.root / pool_id / kind))
                except (FileNotFoundError, NotADirectoryError):
                    continue
                for name in names:
                    if name.startswith(".") or not name.endswith(".json"):
                        continue
                    key = (pool_id, kind, name[:-5])
                    try:
                        att = self.read(*key)
                    except InvalidArgument:
                        continue
                    except FailedPrecondition as exc:
                        out.unreadable[key] = exc.message
                        continue
                    if att is not None:
                        out.found.append(att)
        return out

    def attached(self) -> set[Key]:
        """(pool ID, kind, object ID) of every object some Instance of this node has
        open, by the records (an unreadable record counts: ownership is unclear)."""
        scan = self.scan()
        return {a.key for a in scan.found} | set(scan.unreadable)

    # ------------------------------------------------------------------ at start

    def _instances(self) -> tuple[dict[str, dict[Key, int] | None], set[str]]:
        """Instance ID → the objects its record says it holds open (None when the
        Instance ended or released them); and the IDs whose record is unreadable."""
        base = self.storage_root / "runtime" / "instances"
        out: dict[str, dict[Key, int] | None] = {}
        unclear: set[str] = set()
        try:
            dirs = sorted(p for p in base.iterdir() if p.is_dir())
        except FileNotFoundError:
            return out, unclear
        for d in dirs:
            try:
                rec = records.read_instance_record(d)
            except FailedPrecondition:
                rec = None
            if rec is None:
                unclear.add(d.name)
                continue
            out[d.name] = _held(rec)
        return out, unclear

    def reconcile(self) -> Reconciled:
        """Bring the records in line with the Instance records (module table)."""
        done = Reconciled()
        instances, unclear = self._instances()
        scan = self.scan()
        present = {a.key for a in scan.found} | set(scan.unreadable)
        for att in scan.found:
            if att.instance_id in unclear:
                done.kept.append(att)
                continue
            held = instances.get(att.instance_id)
            if held is not None and att.key in held:
                done.kept.append(att)
                continue
            if self.remove(*att.key, instance_id=att.instance_id):
                done.deleted.append(att)
                log.info("attachment record deleted at start", pool=att.pool_id,
                         kind=att.kind, object=att.object_id, instance=att.instance_id,
                         why="instance ended or released it" if held is None
                         else "instance record does not hold it")
        for instance_id, held in sorted(instances.items()):
            for key, epoch in sorted((held or {}).items()):
                if key in present:
                    continue
                try:
                    done.written.append(self.record(*key, instance_id=instance_id,
                                                    epoch=epoch))
                except InvalidArgument as exc:  # a held entry that names no object
                    log.error("attachment record not written: bad held entry",
                              instance=instance_id, entry=str(key), error=exc.message)
                    continue
                present.add(key)
                log.info("attachment record written from the Instance record",
                         pool=key[0], kind=key[1], object=key[2], instance=instance_id)
        for key, why in scan.unreadable.items():
            log.error("attachment record unreadable: left alone", pool=key[0], kind=key[1],
                      object=key[2], error=why)
        return done


def _held(rec: dict[str, Any]) -> dict[Key, int] | None:
    """The objects an Instance record holds open, or None when it released them."""
    if rec.get("released") or rec.get("state") in _ENDED:
        return None
    out: dict[Key, int] = {}
    for h in rec.get("held") or []:
        if isinstance(h, dict) and isinstance(h.get("epoch"), int):
            out[(str(h.get("pool_id")), str(h.get("kind")), str(h.get("object_id")))] = \
                h["epoch"]
    return out

