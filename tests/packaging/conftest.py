"""The Debian packages, built once per test session from a clean copy of HEAD with
packaging/deb/build.sh (gzip-compressed via ``KIBOTOS_DEB_COMPRESS=-Zgzip`` to save a
minute; everything else is the same), for test_deb.py and test_deb_in_systemd.py.
Set ``KIBOTOS_TEST_DEBS`` to a directory of built packages to check those instead."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
CLEAN_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
#: The binary packages by role (debian/control).
PACKAGES = ("kibotos-common", "kibotos-node", "kibotos-ctrl", "kibotos-cli",
            "kibotos-e2b-gateway", "kibotos-exposure-gateway")


@pytest.fixture(scope="session")
def revision() -> str:
    """The commit the packages are built from (HEAD now; others may commit meanwhile)."""
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()


def _by_package(paths: list[Path]) -> dict[str, Path]:
    found = {p.name.split("_")[0]: p for p in paths}
    assert sorted(found) == sorted(PACKAGES), paths
    return found


@pytest.fixture(scope="session")
def debs(tmp_path_factory: pytest.TempPathFactory, revision: str) -> dict[str, Path]:
    """Package name -> its .deb."""
    given = os.environ.get("KIBOTOS_TEST_DEBS")
    if given:
        return _by_package(sorted(Path(given).glob("*.deb")))
    missing = [t for t in ("dpkg-buildpackage", "dh", "git")
               if shutil.which(t, path=CLEAN_PATH) is None]
    if missing:
        if IN_CI:
            pytest.fail(f"missing build tools {missing} (packaging/apt-test-deps.txt)")
        pytest.skip(f"missing build tools {missing}")
    out = tmp_path_factory.mktemp("debs")
    env = dict(os.environ, KIBOTOS_DEB_COMPRESS="-Zgzip")
    proc = subprocess.run([str(REPO / "packaging/deb/build.sh"), "--rev", revision,
                           "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    paths = [Path(line) for line in proc.stdout.split()]
    assert all(p.is_file() and p.parent == out for p in paths), paths
    return _by_package(paths)
