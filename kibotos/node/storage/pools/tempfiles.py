"""Removal of temporary files left by interrupted writes (spec: node-and-vmm-processes,
"Temporary files from interrupted writes").

Every write goes to a temporary dot-file first (`kibotos.core.atomicfile.temp_name`:
``.<prefix>.<stem>-<random>.tmp``; staging archives end in ``.tar``) and is renamed
when complete, so a file of that shape that exists at node start belongs to a write
that will never finish.  Which ones go:

========================  ==============================================================
local node directories    all
a dedicated pool          all (a pool unavailable at start: when it becomes available)
a shared pool             only those starting with ``.<this node's ID>.``; the rest may
                          be another node's write in progress, and files without a node
                          ID (v0.1.x) are left and logged for the operator
========================  ==============================================================

Object files never start with a dot (IDs cannot), so the shape alone tells them apart.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kibotos.node.storage.pools.dirs import SUBDIRS

#: ``.[<node>.]<stem>-<digits>.tmp|tar``
TEMP_NAME = re.compile(r"\.(?:(?P<node>[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)\.)?"
                       r"(?P<stem>.+)-(?P<rand>[0-9]+)\.(?:tmp|tar)")


def is_temp_name(name: str) -> bool:
    return TEMP_NAME.fullmatch(name) is not None


@dataclass
class Sweep:
    """What one cleanup did: deleted paths, and temporary files it had to leave."""

    deleted: list[Path] = field(default_factory=list)
    left: list[Path] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _remove(path: Path, sweep: Sweep) -> None:
    try:
        path.unlink()
        sweep.deleted.append(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        sweep.errors.append(f"{path}: {exc.strerror or exc}")


def pool_dirs(pool_path: Path) -> list[Path]:
    """The directories of a pool where the node writes: the pool directory (the marker's
    temporary file) and every fixed subdirectory."""
    out = [pool_path]
    for kind, subs in SUBDIRS.items():
        out.append(pool_path / kind)
        out.extend(pool_path / kind / sub for sub in subs)
    return out


def sweep_pool(pool_path: Path, *, shared: bool, node_id: str) -> Sweep:
    """Delete leftovers in one pool by the table above."""
    sweep = Sweep()
    own = f".{node_id}."
    for directory in pool_dirs(pool_path):
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            if not name.startswith(".") or not is_temp_name(name):
                continue
            path = directory / name
            if not path.is_file() or path.is_symlink():
                continue
            if shared and not name.startswith(own):
                sweep.left.append(path)
                continue
            _remove(path, sweep)
    return sweep


def sweep_local(root: Path, *, skip: Iterable[Path] = ()) -> Sweep:
    """Delete every leftover under the node's own directory `root`, not descending into
    `skip` (pool directories that live under it follow the pool rules) nor into other
    file systems or symlinks."""
    sweep = Sweep()
    skipped = {os.path.realpath(p) for p in skip}
    try:
        root_dev = os.lstat(root).st_dev
    except OSError:
        return sweep
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        keep = []
        for d in dirnames:
            full = os.path.join(dirpath, d)
            try:
                if os.path.realpath(full) in skipped or os.lstat(full).st_dev != root_dev:
                    continue
            except OSError:
                continue
            keep.append(d)
        dirnames[:] = keep
        for name in filenames:
            if name.startswith(".") and is_temp_name(name):
                path = Path(dirpath) / name
                if path.is_file() and not path.is_symlink():
                    _remove(path, sweep)
    return sweep
