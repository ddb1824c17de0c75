"""The build a node-run process runs, as the node compares it when it finds one running.

The spec adopts a running data-plane or egress process only when it is the same build
as the node.  A packaged build carries its source revision, which is exact:
``<version>+<revision>``.  A checkout says ``unknown``, so there the build is named by
a digest of the Python sources the process runs: a developer who edits them and
restarts the node gets a new process instead of silently keeping the old code, and an
edit elsewhere in the tree does not replace it.  Each process names its own sources
(`kibotos.dataplane.process.build`, `kibotos.egress.build`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import kibotos
from kibotos._version import SOURCE_REVISION, __version__


def source_build_id(sources: Iterable[str]) -> str:
    """The build a process started now would run, of the package's `sources`
    (directories and files, relative to the package)."""
    if SOURCE_REVISION != "unknown":
        return f"{__version__}+{SOURCE_REVISION}"
    root = Path(kibotos.__file__).parent
    digest = hashlib.sha256()
    files = sorted(p for name in sources for p in (
        (root / name).rglob("*.py") if (root / name).is_dir() else [root / name]))
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return f"{__version__}+src.{digest.hexdigest()[:16]}"
