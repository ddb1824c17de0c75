"""Clean-up and the VM preconditions shared by the end-to-end fixtures."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def vm_test_cache(tools: Sequence[str], what: str, root_for: str) -> Path:
    """The VM tests' build cache (tests/vm/conftest.py `_cache_root`) once `tools` and
    root are there; otherwise a skip, or a failure under CI (where they must be)."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [t for t in tools if shutil.which(t, path=path) is None]
    if os.geteuid() != 0:
        missing.append(f"root ({root_for})")
    if missing:
        msg = f"{what} needs {', '.join(missing)} (packaging/apt-test-deps.txt)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    env = os.environ.get("KIBOTOS_TEST_CACHE")
    return Path(env) if env else Path("/var/cache/kibotos-test")


def remove_short_links_into(directory: Path) -> None:
    """The dev cluster keeps short /tmp links to storage roots whose socket paths would
    be too long (kibotos.dev.layout), and, as root, its PostgreSQL server's files under
    /tmp; a test's cluster directory goes away with the test, so they go too."""
    for link in Path("/tmp").glob("kibotos-dev-*"):
        if link.is_symlink() and Path(os.readlink(link)).is_relative_to(directory):
            link.unlink(missing_ok=True)
    # The other way round: a PostgreSQL server run as root keeps its files under /tmp,
    # linked from the cluster directory (kibotos.dev.postgres).
    for link in directory.glob("**/postgres"):
        target = Path(os.readlink(link)) if link.is_symlink() else None
        if target is not None and target.name.startswith("kibotos-pg-"):
            shutil.rmtree(target, ignore_errors=True)
