"""Clean-up shared by the end-to-end fixtures."""

from __future__ import annotations

import os
from pathlib import Path


def remove_short_links_into(directory: Path) -> None:
    """The dev cluster keeps short /tmp links to storage roots whose socket paths would
    be too long (kibotos.dev.layout); a test's cluster directory goes away with the test,
    so its links go too."""
    for link in Path("/tmp").glob("kibotos-dev-*"):
        if link.is_symlink() and Path(os.readlink(link)).is_relative_to(directory):
            link.unlink(missing_ok=True)
