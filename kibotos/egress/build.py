"""What "the same build" means when the node finds an egress process running.

As for the data plane (`kibotos.dataplane.process.build`): a packaged build is
``<version>+<source revision>``; a checkout, whose revision is ``unknown``, is named by a
digest of the sources the egress process runs, so an edit to them gives a new process
at the next node start instead of silently keeping the old code.  The version before
the ``+`` is what the node compares release lines with
(`kibotos.node.runtime.build_identity.same_release_line`).
"""

from __future__ import annotations

import functools

from kibotos import source_build

#: What an egress process runs, relative to the package.
SOURCES = ("egress", "core", "control_socket.py", "source_build.py")


@functools.cache
def build_id() -> str:
    """The build this process loaded (computed at the first call)."""
    return source_build_id()


def source_build_id() -> str:
    """The build a process started now would run."""
    return source_build.source_build_id(SOURCES)
