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

from kibotos import source_build

#: What a data-plane process runs, relative to the package: directories and files.
SOURCES = ("dataplane", "guest", "core", "control_socket.py", "source_build.py")


@functools.cache
def build_id() -> str:
    """The build this process loaded (computed once, at the first call: the process's
    code does not change when files are edited afterwards)."""
    return source_build_id()


def source_build_id() -> str:
    """The build a process started now would run: ``<version>+<revision>``, or
    ``<version>+src.<digest>`` for a checkout.  The node compares a running data plane's
    `build_id` with this."""
    return source_build.source_build_id(SOURCES)
