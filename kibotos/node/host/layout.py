"""The node's directories under ``<storage.root>`` and in each pool, and its owner lock.

Preparing the layout is the first thing a node does, before it writes any state, so a
wrong root or an unmounted pool stops the start with a message that names the path.
The node never creates a pool directory itself: an absent one usually means the pool is
not mounted yet, and creating it would write the node's objects onto the root disk.
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from kibotos.config import NodeConfig, PoolSection
from kibotos.core.errors import FailedPrecondition
from kibotos.core.path_tables import Below
from kibotos.node.host.vmm_access import hand_path_to_instances
from kibotos.node.storage.pools.dirs import SUBDIRS, prepare_pool_dirs

#: Subdirectories of ``<storage.root>`` (docs/architecture.md, "Node state on disk").
ROOT_DIRS = ("pki", "state", "runtime", "installations", "template-cache", "network",
             "machine-logs")
#: Subdirectories the node manages inside each pool directory.
POOL_DIRS = tuple(SUBDIRS)


@dataclass(frozen=True)
class NodePaths:
    """Where each piece of node state lives; derived from ``storage.root`` only."""

    root: Path

    pki = Below("root", "pki")
    identity_file = Below("pki", "identity.json")
    state = Below("root", "state")
    incarnation_file = Below("state", "incarnation")
    runtime = Below("root", "runtime")
    lock_file = Below("runtime", "node.lock")


def prepare_root(paths: NodePaths) -> None:
    """Check the storage root and create its subdirectories (mode 0700: identity, launch
    records and logs are not for other local users; the VMM group may only traverse
    the root and runtime/ to the Instance directories, `kibotos.node.host.vmm_access`)."""
    root = paths.root
    if root.exists() and not root.is_dir():
        raise FailedPrecondition(f"prepare host layout: storage.root {root} is not a directory")
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for name in ROOT_DIRS:
            (root / name).mkdir(mode=0o700, exist_ok=True)
        # The path to the Instance directories, for VMMs that run as kibotos-vmm.
        hand_path_to_instances(root)
    except OSError as exc:
        raise FailedPrecondition(
            f"prepare host layout: create {exc.filename or root}: {exc.strerror}"
        ) from None


def prepare_pool(pool: PoolSection) -> None:
    """Create the node's subdirectories in an existing pool directory, with the spec's
    owners and modes (`kibotos.node.storage.pools.dirs.prepare_pool_dirs`, which also carries
    the message spec/storage-pools-on-nfs.txt tells operators to look for when the pool
    directory is missing)."""
    prepare_pool_dirs(pool.id, pool.path)


def prepare_layout(config: NodeConfig) -> NodePaths:
    """The storage root and the pool layouts (`serve_node` does the same in two steps:
    the pools under its owner lock, by `kibotos.node.storage.pools.startup.prepare`)."""
    paths = NodePaths(config.storage.root)
    prepare_root(paths)
    for pool in config.storage.pool:
        prepare_pool(pool)
    return paths


class OwnerLock:
    """``flock`` on ``runtime/node.lock``: one node process per storage root.

    Two node processes on one root would hand out the same incarnation and fight over
    the same launch records.  The kernel drops the lock when the process dies (even by
    SIGKILL), so a stale lock file never blocks a restart."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise FailedPrecondition(
                    f"another node process holds {self.path}"
                    + (f" (pid {holder})" if holder else "")
                    + ": one node process per storage root"
                ) from None
            raise FailedPrecondition(f"cannot lock {self.path}: {exc.strerror}") from None
        # The PID is for people reading the file; the lock itself is the flock.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OwnerLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return ""
