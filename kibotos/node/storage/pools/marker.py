"""The pool marker ``<pool>/.kibotos-storage-pool`` and ``storage-pool init``.

The marker proves that a directory is the pool the configuration declares: a pool that
is not mounted (so its path is an empty directory on the root disk) or a directory
mounted in the wrong place then shows up as unavailable instead of silently receiving
Workspace data.  ``instance`` is generated once, at init, and identifies the storage
itself: every node of a shared pool reads the same file and reports the same value,
while a second directory given the same pool ID gets another one, which ctrl refuses.

Only `init_pool` writes the marker; the node only reads it (`check_marker`).  Init
never overwrites one: running it again with the same ID is a no-op, with another ID it
is refused.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kibotos.core import atomicfile, ids
from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.node.storage.pools.dirs import TOP_MODE, vmm_gid

MARKER_NAME = ".kibotos-storage-pool"
MARKER_VERSION = 1
#: The availability reason of a pool whose marker is absent (spec, Troubleshooting).
MISSING_REASON = "storage pool marker is missing"
INVALID_PREFIX = "storage pool marker is invalid"
_HEX = frozenset("0123456789abcdef")


def rfc3339_ns(ns: int | None = None) -> str:
    """``2026-09-17T20:20:23.084208280Z``: UTC, nanoseconds, ``Z`` (the spec's shape)."""
    ns = time.time_ns() if ns is None else ns
    seconds, frac = divmod(ns, 1_000_000_000)
    stamp = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}.{frac:09d}Z"


@dataclass(frozen=True)
class Marker:
    pool_id: str
    instance: str
    created_at: str
    version: int = MARKER_VERSION

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "pool_id": self.pool_id,
                "instance": self.instance, "created_at": self.created_at}


class MarkerProblem(Exception):
    """Why a marker cannot be used; `reason` is the availability reason as shown."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def marker_path(pool_path: Path) -> Path:
    return pool_path / MARKER_NAME


def parse_marker(raw: bytes, where: Path) -> Marker:
    """The marker in `raw`, or `MarkerProblem` saying what is wrong with it."""
    def bad(what: str) -> MarkerProblem:
        return MarkerProblem(f"{INVALID_PREFIX}: {where}: {what}")

    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise bad("not a JSON object")
    version = value.get("version")
    if version != MARKER_VERSION or isinstance(version, bool):
        raise bad(f"unsupported version {version!r} (this node reads version "
                  f"{MARKER_VERSION})")
    pool_id = value.get("pool_id")
    try:
        ids.check_pool_id(pool_id)
    except InvalidArgument as exc:
        raise bad(exc.message) from None
    instance = value.get("instance")
    if not isinstance(instance, str) or len(instance) != 32 or not set(instance) <= _HEX:
        raise bad(f"instance {instance!r} is not 32 lowercase hex digits")
    created_at = value.get("created_at")
    if not isinstance(created_at, str) or not created_at.endswith("Z"):
        raise bad(f"created_at {created_at!r} is not an RFC 3339 UTC time")
    assert isinstance(pool_id, str)
    return Marker(pool_id=pool_id, instance=instance, created_at=created_at)


def read_marker(pool_path: Path) -> Marker | None:
    """The marker of `pool_path`, None when there is none; `MarkerProblem` when it is
    unreadable or malformed.  Read from disk every time (another host may write it)."""
    path = marker_path(pool_path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise MarkerProblem(f"{INVALID_PREFIX}: {path} is a directory") from None
    except OSError as exc:
        raise MarkerProblem(f"{INVALID_PREFIX}: cannot read {path}: "
                            f"{exc.strerror or exc}") from None
    return parse_marker(raw, path)


def check_marker(pool_id: str, pool_path: Path) -> Marker:
    """The marker of the pool the configuration declares as `pool_id` at `pool_path`;
    `MarkerProblem` with the spec's reason when it is missing, invalid or names another
    pool.  The node never creates or repairs it."""
    marker = read_marker(pool_path)
    if marker is None:
        raise MarkerProblem(MISSING_REASON)
    if marker.pool_id != pool_id:
        raise MarkerProblem(
            f"{INVALID_PREFIX}: {marker_path(pool_path)} names pool {marker.pool_id!r}, "
            f"but the configuration declares pool {pool_id!r} at this path")
    return marker


@dataclass(frozen=True)
class InitResult:
    marker: Marker
    created: bool  # False: the pool was initialized already with this ID
    path: Path


def init_pool(pool_id: str, path: Path, *, adopt: bool = False) -> InitResult:
    """``kibotos-node storage-pool init``: every rule of "Initializing a pool".

    * a bad ID or a relative path is refused before anything is written;
    * a missing directory is created (its parents too), root:kibotos-vmm 0710 as the
      spec's "Prerequisites" ask of a pool directory;
    * a directory that already has a marker: the same ID is a no-op, another ID is
      refused and the marker is left as it is;
    * a non-empty directory without a marker is refused unless `adopt` (it keeps the
      data and only adds the marker);
    * the marker is written atomically and only if it is still absent at the last
      moment (hard link of the finished file: never overwrites a concurrent init).
    """
    ids.check_pool_id(pool_id)
    if not path.is_absolute():
        raise InvalidArgument(f"invalid pool path {str(path)!r}: must be an absolute path")
    if path.exists() and not path.is_dir():
        raise FailedPrecondition(f"pool path {path} exists and is not a directory")
    existing = _existing(pool_id, path)
    if existing is not None:
        return InitResult(existing, False, path)
    if path.is_dir():
        entries = sorted(os.listdir(path))
        if entries and not adopt:
            shown = ", ".join(entries[:5]) + (", …" if len(entries) > 5 else "")
            raise FailedPrecondition(
                f"pool directory {path} is not empty and has no marker ({shown}); "
                "add --adopt to keep its data and only add the marker",
                details={"reason": "not_empty"})
    else:
        try:
            path.mkdir(mode=TOP_MODE, parents=True)
            # The mode and owner the spec's "Prerequisites" ask the operator to give a
            # pool directory, so the node's traversal check passes on a directory init
            # made (the node itself never changes the pool directory).
            if os.geteuid() == 0:
                os.chown(path, 0, vmm_gid())
            os.chmod(path, TOP_MODE)
        except FileExistsError:
            pass
        except OSError as exc:
            raise FailedPrecondition(f"create pool directory {path}: "
                                     f"{exc.strerror or exc}") from None
    marker = Marker(pool_id=pool_id, instance=secrets.token_hex(16),
                    created_at=rfc3339_ns())
    if not _write_new(path, marker):  # another init won the race
        existing = _existing(pool_id, path)
        assert existing is not None
        return InitResult(existing, False, path)
    return InitResult(marker, True, path)


def _existing(pool_id: str, path: Path) -> Marker | None:
    """The marker already there, if it is this pool's; refusal otherwise."""
    try:
        marker = read_marker(path)
    except MarkerProblem as exc:
        raise FailedPrecondition(
            f"{exc.reason}; not overwriting it (move it away only if this directory is "
            "really not a pool)") from None
    if marker is None:
        return None
    if marker.pool_id != pool_id:
        raise FailedPrecondition(
            f"{marker_path(path)} already names pool {marker.pool_id!r} (instance "
            f"{marker.instance}); refusing to initialize it as {pool_id!r}",
            details={"reason": "other_pool", "pool_id": marker.pool_id})
    return marker


def _write_new(path: Path, marker: Marker) -> bool:
    """Write the marker durably; False (nothing changed) when one appeared meanwhile.

    A temporary file, fsynced, then ``link`` to the final name: unlike ``rename``, a
    link fails when the name exists, so two concurrent inits cannot both win."""
    target = marker_path(path)
    tmp = atomicfile.temp_name(target)
    data = json.dumps(marker.to_json(), indent=2).encode() + b"\n"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, target)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    atomicfile.fsync_dir(path)
    return True
