"""What "the same build" means when the node finds a data-plane process running.

The spec adopts a running data-plane process only when it is the same build as the
node.  A packaged build carries its source revision, which is exact.  A checkout says
``unknown``, so there the build is named by a digest of the package's Python sources:
a developer who edits the data plane and restarts the node gets a new process instead
of silently keeping the old code.  Only the modules the data-plane process runs count
(`SOURCES`), so an edit elsewhere in the tree does not replace it.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import kibotos
from kibotos._version import SOURCE_REVISION, __version__

#: What a data-plane process runs, relative to the package: directories and files.
SOURCES = ("dataplane", "guest", "credentials.py")


@functools.cache
def build_id() -> str:
    """The build this process loaded (computed once, at the first call: the process's
    code does not change when files are edited afterwards)."""
    return source_build_id()


def source_build_id() -> str:
    """The build a process started now would run: ``<version>+<revision>``, or
    ``<version>+src.<digest>`` for a checkout.  The node compares a running data plane's
    `build_id` with this."""
    if SOURCE_REVISION != "unknown":
        return f"{__version__}+{SOURCE_REVISION}"
    root = Path(kibotos.__file__).parent
    digest = hashlib.sha256()
    files = sorted(p for name in SOURCES for p in (
        (root / name).rglob("*.py") if (root / name).is_dir() else [root / name]))
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return f"{__version__}+src.{digest.hexdigest()[:16]}"
