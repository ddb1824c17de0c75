"""Fixtures of the VM tests: a real Platform and ``kibotos-base`` Template, built once.

Both are built by the same code as ``packaging/*/build.sh`` into a cache that outlives
the test session (``$KIBOTOS_TEST_CACHE``, else /var/cache/kibotos-test as root, else
~/.cache/kibotos-test), keyed by the digest of their inputs: the first run pays the
debootstrap (~50 s) and the kernel download, reruns take a second, and a changed agent
or init rebuilds only what depends on it.

The tools come from ``packaging/apt-test-deps.txt``.  Without them the VM tests are
skipped on a developer's machine but fail under CI (``CI=true``), where `.ci/run`
installs them: a green CI must not hide a skipped VM path.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kibotos.platform.build_platform import build_platform
from kibotos.platform.build_template import build_template, default_recipe

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
TOOLS = ("qemu-system-x86_64", "debootstrap", "mkfs.ext4", "debugfs", "dpkg-deb",
         "apt-cache", "apt-get")


def _cache_root() -> Path:
    env = os.environ.get("KIBOTOS_TEST_CACHE")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/cache/kibotos-test")
    return Path.home() / ".cache" / "kibotos-test"


def _need_tools() -> None:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [t for t in TOOLS if shutil.which(t, path=path) is None]
    if os.geteuid() != 0:
        missing.append("root (debootstrap)")
    if missing:
        msg = f"VM tests need {', '.join(missing)} (packaging/apt-test-deps.txt)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def vm_cache() -> Path:
    _need_tools()
    root = _cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def platform_dir(vm_cache: Path) -> Path:
    return build_platform(cache_root=vm_cache)


@pytest.fixture(scope="session")
def template_dir(vm_cache: Path) -> Path:
    return build_template(default_recipe(), cache_root=vm_cache)


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    """An Instance runtime directory.  Unix socket paths are limited to 107 bytes, so it
    lives under a short /tmp name rather than pytest's long tmp_path."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="kvm-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
