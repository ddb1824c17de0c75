"""What "the same build" means when the node finds an egress process running.

As for the data plane (`kibotos.dataplane.build`): a packaged build is
``<version>+<source revision>``; a checkout, whose revision is ``unknown``, is named by a
digest of the sources the egress process runs, so an edit to them gives a new process
at the next node start instead of silently keeping the old code.  The version before
the ``+`` is what the node compares release lines with.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import kibotos
from kibotos._version import SOURCE_REVISION, __version__

#: What an egress process runs, relative to the package.
SOURCES = ("egress", "errors.py", "logs.py")


@functools.cache
def build_id() -> str:
    """The build this process loaded (computed at the first call)."""
    return source_build_id()


def source_build_id() -> str:
    """The build a process started now would run."""
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


def version_of(build: str) -> str:
    """The release version a build string carries (before the ``+``)."""
    return build.partition("+")[0]
