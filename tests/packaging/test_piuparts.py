"""piuparts on the built packages (tests/packaging/conftest.py builds them once):
install and purge of all six, and an upgrade from the previous release, each in a
fresh Debian 12 chroot with no systemd booted.

piuparts records the chroot, installs, removes and purges, and fails on any file the
packages leave, change or take away, on a maintainer script that fails, and on
anything left running.  It resolves the packages' dependencies through apt before it
installs the packages themselves, so the packages under test are also offered to the
chroot as a local apt repository (``--extra-repo`` of a ``--bindmount``ed directory
with a ``Packages`` index); the upgrade test's repository holds the same build
repacked as release 0.0.9 (tests/packaging/repack.py), which piuparts installs from
that repository before it upgrades to the built packages and purges them.

Cost: the chroot is a copy of the systemd test's cached debootstrapped root file
system (tests/packaging/nspawn_container.py: Debian 12 minbase with the packages'
dependencies already in it, so nothing but apt's lists is downloaded); both tests
take about three minutes here, the packages built.  The chroot's apt reads the Debian mirror
(``kibotos.platform.aptsources.debian_mirror``), as debootstrap does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from nspawn_container import SUITE, rootfs
from repack import repack

from kibotos.platform.aptsources import debian_mirror

TIMEOUT = 1800
pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.piuparts,
              pytest.mark.timeout(TIMEOUT + 300)]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
TOOLS = ("piuparts", "debootstrap", "dpkg-scanpackages")
#: The release the upgrade starts from: older than any build of this tree.
PREVIOUS = "0.0.9"


@pytest.fixture(scope="module")
def base_chroot() -> Path:
    missing = [t for t in TOOLS if shutil.which(t, path=PATH) is None]
    if missing:
        if IN_CI:
            pytest.fail(f"missing {missing} (packaging/apt-test-deps.txt)")
        pytest.skip(f"missing {missing}")
    return rootfs(Path(os.environ.get("KIBOTOS_TEST_CACHE", "/var/cache/kibotos-test")))


def _repository(debs: list[Path], directory: Path) -> Path:
    """A flat apt repository of `debs` (already in `directory`, or copied there)."""
    directory.mkdir(exist_ok=True)
    for deb in debs:
        if deb.parent != directory:
            shutil.copy(deb, directory / deb.name)
    index = subprocess.run(["dpkg-scanpackages", "--multiversion", "."], cwd=directory,
                           capture_output=True, text=True, check=True, timeout=300,
                           env={"PATH": PATH})
    (directory / "Packages").write_text(index.stdout)
    return directory


def _piuparts(base: Path, repository: Path, debs: dict[str, Path], log: Path,
              *options: str) -> str:
    argv = ["piuparts", "--distribution", SUITE, "--mirror", debian_mirror(SUITE),
            "--existing-chroot", str(base), f"--bindmount={repository}",
            f"--extra-repo=deb [trusted=yes] file://{repository} ./",
            # A dependency's own bookkeeping (e.g. a trigger's cache) is not ours to fail on.
            "--warn-on-others", "--log-file", str(log), *options,
            *map(str, debs.values())]
    proc = subprocess.run(argv, cwd=log.parent, capture_output=True, text=True,
                          timeout=TIMEOUT, check=False, env={"PATH": PATH, "LANG": "C.UTF-8"})
    text = log.read_text() if log.exists() else proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-8000:]
    return text


def test_piuparts_install_and_purge(debs: dict[str, Path], base_chroot: Path,
                                    tmp_path: Path) -> None:
    repository = _repository(list(debs.values()), tmp_path / "repo")
    log = _piuparts(base_chroot, repository, debs, tmp_path / "piuparts.log",
                    "--no-upgrade-test")
    assert "PASS: Installation and purging test." in log
    assert "PASS: All tests." in log


def test_piuparts_upgrade_from_the_previous_release(debs: dict[str, Path],
                                                    base_chroot: Path,
                                                    tmp_path: Path) -> None:
    repack(debs, tmp_path / "repo", PREVIOUS)
    repository = _repository(sorted((tmp_path / "repo").glob("*.deb")), tmp_path / "repo")
    log = _piuparts(base_chroot, repository, debs, tmp_path / "piuparts.log",
                    "--no-install-purge-test")
    assert "PASS: Installation, upgrade and purging tests." in log
    # The old kibotos-node's prerm checked with the old binary (docs/packaging.md,
    # "Package ordering").
    assert f"check-maintenance --operation upgrade with the installed kibotos-node {PREVIOUS}" \
        in log
    assert "PASS: All tests." in log
