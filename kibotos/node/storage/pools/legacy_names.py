"""Objects still named by the SHA-256 of their ID, renamed to their IDs (spec:
storage-pools-on-nfs, "File names and object IDs" and "Same file under two names").

Versions before v0.1.0 named an object's files ``<sha256(id)>.<ext>`` (64 lowercase
hex characters); IDs are at most 32 bytes, so the two shapes never meet.  When each
object is renamed:

* at start (`rename_at_start`, when the pool is first seen available): the objects this
  node holds that no Instance of this node has attached (its attachment records,
  `kibotos.node.records.attachments`).  "Holds" = its holder record
  names this node; in a dedicated pool an object without any holder record counts too
  (nothing else can use it).  In a shared pool only the holder renames;
* before every attach, release and delete (`settle`, called by
  `kibotos.node.storage.objects.PoolObjects`): the command carries ctrl's epoch, i.e. ctrl made
  this node the holder, so the node renames before it takes the object over.  A
  release therefore renames an object attached under its old names, and a node taking
  over an object finishes a rename another node left half done.

A rename moves the files in a fixed order, metadata last (`ORDER`): as long as the old
metadata exists, the object can be identified from its old name, so whoever uses the
object next finishes the job.  Each file is moved by hard link then unlink: the link
fails instead of replacing a file under the new name, and a file present under both
names *as the same inode* is our own interrupted move (finished by dropping the old
name), while two different files are the spec's "same file under two names": renaming
of that object stops and operations on it fail with `DigestNameConflict` (retryable,
``unavailable``) naming both files, until the operator moves the extra copy away; the
next retry then renames it, without a restart.

Log lines: ``node storage objects by name pool=… renamed=… digest_names=…`` (once per
pool, at start) and ``node storage objects kept digest names … error=…`` for each
object that stays under its old names because of a conflict.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from kibotos.core import atomicfile, failpoints, ids
from kibotos.core.errors import InvalidArgument, Unavailable
from kibotos.core.logs import EventLogger
from kibotos.node.records.attachments import Attachments
from kibotos.node.storage.objects import Holder, Opened, PoolObjects, UseRightTakenOver
from kibotos.node.storage.pools.dirs import RETAINED_LAYERS, VOLUMES

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kibotos.config import PoolSection

log = EventLogger()

DIGEST_NAME = re.compile(r"[0-9a-f]{64}")
#: The order files of one object are renamed in; metadata last (spec).
ORDER: tuple[tuple[str, str], ...] = (("locks", ".lock"), ("data", ".ext4"),
                                      ("holders", ".json"), ("releases", ".json"),
                                      ("metadata", ".json"))
KINDS = (RETAINED_LAYERS, VOLUMES)
#: Fields an old metadata record may carry the object's ID in (first match wins).
_ID_FIELDS = ("id", "volume_id", "opaque_ref", "ref")
#: link() refusals that mean "this file system has no hard links", not a conflict.
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK}


def _is_object_id(value: str) -> bool:
    try:
        ids.check_object_id(value)
    except InvalidArgument:
        return False
    return True


def digest_name(object_id: str) -> str:
    """The name versions before v0.1.0 gave the object (``printf '%s' ID | sha256sum``)."""
    return hashlib.sha256(object_id.encode()).hexdigest()


class DigestNameConflict(Unavailable):
    """A file of the object exists under both names: the node does not choose a copy.
    Retryable: once the operator moves the extra copy away, the next try renames."""


@dataclass(frozen=True)
class Pair:
    sub: str
    old: Path
    new: Path


def pairs(root: Path, object_id: str) -> list[Pair]:
    """Old and new path of each file of the object under `root` (``<pool>/<kind>``), in
    rename order."""
    hexname = digest_name(object_id)
    return [Pair(sub, root / sub / f"{hexname}{ext}", root / sub / f"{object_id}{ext}")
            for sub, ext in ORDER]


def _exists(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def has_old_names(root: Path, object_id: str) -> bool:
    return any(_exists(p.old) is not None for p in pairs(root, object_id))


def _conflict(pair: Pair, object_id: str, kind_label: str) -> DigestNameConflict:
    return DigestNameConflict(
        f"same file under two names: {pair.old} and {pair.new} ({kind_label} {object_id}); "
        "renaming to the ID stopped: move the extra copy out of the pool directory "
        "(docs/storage.md, \"Same file under two names\"), then retry",
        details={"reason": "digest_name_conflict", "object_id": object_id,
                 "old": str(pair.old), "new": str(pair.new)})


def check_conflicts(root: Path, object_id: str, kind_label: str = "object") -> None:
    """Raise `DigestNameConflict` for the first file present under both names as two
    different files (the same inode under both is an interrupted move of ours)."""
    for pair in pairs(root, object_id):
        old, new = _exists(pair.old), _exists(pair.new)
        if old is not None and new is not None and \
                (old.st_dev, old.st_ino) != (new.st_dev, new.st_ino):
            raise _conflict(pair, object_id, kind_label)


def move_file(pair: Pair, object_id: str, kind_label: str) -> bool:
    """Move one file from its old name to its new one; True if something moved."""
    old = _exists(pair.old)
    if old is None:
        return False
    try:
        os.link(pair.old, pair.new, follow_symlinks=False)
    except FileExistsError:
        new = _exists(pair.new)
        if new is None or (new.st_dev, new.st_ino) != (old.st_dev, old.st_ino):
            raise _conflict(pair, object_id, kind_label) from None
    except FileNotFoundError:
        return False  # someone else moved it meanwhile
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        if _exists(pair.new) is not None:
            raise _conflict(pair, object_id, kind_label) from None
        os.rename(pair.old, pair.new)
        atomicfile.fsync_dir(pair.new.parent)
        return True
    failpoints.hit("node.legacy-name.after-link")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pair.old)
    atomicfile.fsync_dir(pair.new.parent)
    return True


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def rename_object(root: Path, object_id: str, kind_label: str = "object") -> bool:
    """Rename every file of the object still under its old name, in `ORDER`.

    Checks every file for a conflict first, so a conflict stops the rename before
    anything moves.  The lock file goes first (it is empty, and the flock that guards
    the rest is taken on its new name); the rest move under that flock.  Returns
    whether anything moved.  Blocking: call it from a worker thread."""
    ids.check_object_id(object_id)
    if not has_old_names(root, object_id):
        return False
    check_conflicts(root, object_id, kind_label)
    steps = pairs(root, object_id)
    moved = move_file(steps[0], object_id, kind_label)
    with _flock(steps[0].new):
        check_conflicts(root, object_id, kind_label)
        for pair in steps[1:]:
            if move_file(pair, object_id, kind_label):
                moved = True
                failpoints.hit("node.legacy-name.after-step")
    return moved


# ---------------------------------------------------------------------- records


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = atomicfile.read_json(path)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _holder(root: Path, object_id: str) -> tuple[str, int, bool] | None:
    """(node_id, epoch, under the old name) of the holder record, whichever name it has
    (the new name when both: a conflict is reported separately)."""
    for path, old in ((root / "holders" / f"{object_id}.json", False),
                      (root / "holders" / f"{digest_name(object_id)}.json", True)):
        rec = _read_json(path)
        if rec is not None and isinstance(rec.get("node_id"), str) and \
                isinstance(rec.get("epoch"), int):
            return rec["node_id"], rec["epoch"], old
    return None


def settle(objects: PoolObjects, object_id: str, epoch: int) -> None:
    """Called by `NamedPoolObjects` before an attach, release or delete carrying `epoch`:
    rename the object if it still has old names and the epoch makes this node its
    holder.  A holder record under the old name with a newer epoch refuses here (the
    objects code reads only new names, so it could not see that record itself).
    Blocking; cheap when nothing has an old name (one lstat per file kind)."""
    root = objects.root
    if not has_old_names(root, object_id):
        return
    holder = _holder(root, object_id)
    if holder is not None:
        node, held_epoch, old = holder
        if held_epoch > epoch or (held_epoch == epoch and node != objects.node_id):
            if not old:
                return  # the takeover table of the objects code refuses it
            raise UseRightTakenOver(
                f"{objects.label} {object_id} in pool {objects.pool_id}: the use right was "
                f"taken over (node {node} holds epoch {held_epoch}, this command carries "
                f"{epoch}); retrying will not succeed",
                details={"reason": "use_right_taken_over", "holder_epoch": held_epoch})
    try:
        if rename_object(root, object_id, objects.label):
            log.info("node storage object renamed to its ID", pool=objects.pool_id,
                     kind=objects.kind, object=object_id, digest=digest_name(object_id))
    except DigestNameConflict as exc:
        log.warning("node storage objects kept digest names", pool=objects.pool_id,
                    kind=objects.kind, object=object_id, error=exc.message)
        raise


class NamedPoolObjects(PoolObjects):
    """`PoolObjects` that first renames an object still under its old names (`settle`)
    before every attach, release and delete; what the node runs (`vmsetup`)."""

    async def open(self, object_id: str, epoch: int, *, create_capacity: int | None = None,
                   lower: Mapping[str, Any] | None = None, **extra: Any) -> Opened:
        self._check(object_id)
        self.check_available()
        await trio.to_thread.run_sync(settle, self, object_id, epoch)
        return await super().open(object_id, epoch, create_capacity=create_capacity,
                                  lower=lower, **extra)

    async def take(self, object_id: str, epoch: int, *, may_create: bool) -> Holder | None:
        """A Workspace's objects are attached by `take` / `wait_released` /
        `finish_open` (`Launcher.open_objects`), not `open`: the rename must come
        before the takeover table here too, or a start would not find the block file
        under its new name (and a first start could make a new one beside the old)."""
        self._check(object_id)
        self.check_available()
        await trio.to_thread.run_sync(settle, self, object_id, epoch)
        return await super().take(object_id, epoch, may_create=may_create)

    async def settle_names(self, object_id: str, epoch: int) -> None:
        self._check(object_id)
        await trio.to_thread.run_sync(settle, self, object_id, epoch)

    def release(self, object_id: str, epoch: int, *, confirmed_on_disk: bool) -> bool:
        settle(self, object_id, epoch)
        return super().release(object_id, epoch, confirmed_on_disk=confirmed_on_disk)

    def delete(self, object_id: str, epoch: int) -> bool:
        self._check(object_id)
        self.check_available()
        settle(self, object_id, epoch)
        return super().delete(object_id, epoch)


# ---------------------------------------------------------------------- at start


def identify(root: Path, hexname: str, known: dict[str, str]) -> str | None:
    """The ID behind an old name: from the old metadata (checked against the digest),
    else from a file already renamed (`known`: digest → ID of the new names here)."""
    rec = _read_json(root / "metadata" / f"{hexname}.json")
    if rec is not None:
        for key in _ID_FIELDS:
            value = rec.get(key)
            if isinstance(value, str) and _is_object_id(value) and \
                    digest_name(value) == hexname:
                return value
    return known.get(hexname)


def scan(root: Path) -> tuple[set[str], dict[str, str]]:
    """The old names (digests) present under `root`, and digest → ID of every new name
    (to identify leftovers whose metadata was already renamed)."""
    digests: set[str] = set()
    known: dict[str, str] = {}
    for sub, ext in ORDER:
        try:
            names = os.listdir(root / sub)
        except OSError:
            continue
        for name in names:
            if not name.endswith(ext) or name.startswith("."):
                continue
            stem = name[:-len(ext)]
            if DIGEST_NAME.fullmatch(stem):
                digests.add(stem)
            elif _is_object_id(stem):
                known.setdefault(digest_name(stem), stem)
    return digests, known


def attached_objects(storage_root: Path) -> set[tuple[str, str, str]]:
    """(pool_id, kind, object_id) some Instance of this node has open: this node's
    attachment records (``runtime/storage-pools/``, `kibotos.node.records.attachments`), which
    the node settled against its Instance records before the pool monitor runs."""
    return Attachments(storage_root).attached()


@dataclass
class Summary:
    """What `rename_at_start` did in one pool."""

    renamed: list[tuple[str, str]] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)  # (kind, digest or ID)
    conflicts: dict[str, str] = field(default_factory=dict)  # object ID → error


def rename_at_start(pool: PoolSection, node_id: str, storage_root: Path) -> Summary:
    """Rename the unattached objects this node holds in `pool`; log the spec's line."""
    summary = Summary()
    attached = attached_objects(storage_root)
    for kind in KINDS:
        root = pool.path / kind
        digests, known = scan(root)
        for hexname in sorted(digests):
            object_id = identify(root, hexname, known)
            if object_id is None or (pool.id, kind, object_id) in attached:
                summary.kept.append((kind, object_id or hexname))
                continue
            holder = _holder(root, object_id)
            mine = holder[0] == node_id if holder is not None else not pool.shared
            if not mine:
                summary.kept.append((kind, object_id))
                continue
            try:
                rename_object(root, object_id, kind)
                summary.renamed.append((kind, object_id))
            except DigestNameConflict as exc:
                summary.kept.append((kind, object_id))
                summary.conflicts[object_id] = exc.message
                log.warning("node storage objects kept digest names", pool=pool.id,
                            kind=kind, object=object_id, error=exc.message)
            except OSError as exc:
                summary.kept.append((kind, object_id))
                log.warning("node storage objects kept digest names", pool=pool.id,
                            kind=kind, object=object_id,
                            error=f"rename failed: {exc.strerror or exc}")
    log.info("node storage objects by name", pool=pool.id, renamed=len(summary.renamed),
             digest_names=len(summary.kept))
    return summary
