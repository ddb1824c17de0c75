"""A directory cache keyed by the digest of a build's inputs.

Each entry is ``<cache>/sha256-<key>/``, built in a temporary directory beside it and
renamed into place only when complete, so a crashed or concurrent build never leaves a
half entry that a later run would trust.  A per-key ``flock`` makes concurrent builders
(parallel test workers, two CI jobs on one host) wait for the first one instead of
debootstrapping twice.  An entry is complete when its manifest file exists.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kibotos.core.atomicfile import fsync_dir, fsync_path
from kibotos.core.errors import FailedPrecondition


def input_key(inputs: Any) -> str:
    """The hex sha256 of the canonical JSON of `inputs` (sorted keys, no spaces)."""
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def default_cache_root() -> Path:
    """``$KIBOTOS_CACHE_DIR``, else /var/cache/kibotos for root, else ~/.cache/kibotos."""
    env = os.environ.get("KIBOTOS_CACHE_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/cache/kibotos")
    return Path.home() / ".cache" / "kibotos"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def cached_build(cache: Path, key: str, manifest: str, build: Callable[[Path], None]) -> Path:
    """The entry for `key`, calling ``build(tmpdir)`` to fill it on a miss.

    `build` writes every file, the `manifest` last, into the directory it is given;
    afterwards the files are fsynced and the directory renamed into place."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FailedPrecondition(f"create cache directory {cache}: {exc.strerror}") from None
    entry = cache / f"sha256-{key}"
    if (entry / manifest).is_file():
        return entry
    with _locked(cache / f".sha256-{key}.lock"):
        if (entry / manifest).is_file():
            return entry
        if entry.exists():
            shutil.rmtree(entry)  # an entry without manifest: a build that did not finish
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{key[:12]}-", dir=cache))
        try:
            build(tmp)
            if not (tmp / manifest).is_file():
                raise FailedPrecondition(f"build of cache entry {key} wrote no {manifest}")
            _fsync_tree(tmp)
            os.chmod(tmp, 0o755)
            os.rename(tmp, entry)
            fsync_dir(cache)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return entry


def _fsync_tree(root: Path) -> None:
    """fsync every regular file and directory under `root`, children first."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            fsync_path(path, os.O_NOFOLLOW)
        fsync_dir(Path(dirpath))
