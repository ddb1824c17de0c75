"""Package ordering during an upgrade (docs/packaging.md, "Package ordering"): the old
kibotos-node's ``prerm upgrade`` must check with the OLD binary, so kibotos-common (the
venv that holds the binary) may be unpacked only after the role packages.

Fast (no package build): stand-in packages with exactly debian/control's relations
between the kibotos packages (tests/packaging/control_relations.py), ordered by the
real apt (a simulated upgrade over a status file of the old versions) and unpacked by
the real dpkg into a private ``--root``.  The upgrade of the real packages on a booted
systemd is tests/packaging/test_deb_in_systemd.py (the prerm prints which version
checks)."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from control_relations import binary_packages, build_stand_in, control_text, relations

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
COMMON = "kibotos-common"
OLD, NEW = "0.1", "0.2"


def _roles() -> list[str]:
    return [name for name in binary_packages() if name != COMMON]


def _need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        if IN_CI:
            pytest.fail(f"missing {missing} (dpkg, apt: part of every Debian host)")
        pytest.skip(f"missing {missing}")


def test_every_role_package_needs_exactly_its_own_common_and_is_broken_by_another() -> None:
    """Depends (= version) keeps the roles on a host one build; kibotos-common's Breaks
    on every other version makes apt and dpkg unpack the role packages first; no
    Pre-Depends on kibotos-common, which would unpack (and configure) it first."""
    packages = binary_packages()
    breaks = relations(packages[COMMON], "Breaks")
    assert _roles(), packages
    for role in _roles():
        assert f"{COMMON} (= ${{binary:Version}})" in relations(packages[role], "Depends")
        assert not any(r.startswith(COMMON) for r in relations(packages[role], "Pre-Depends"))
        assert f"{role} (<< ${{binary:Version}})" in breaks, role
        assert f"{role} (>> ${{binary:Version}})" in breaks, role
    assert "Pre-Depends" not in packages[COMMON]


def _status_of_old_versions() -> str:
    """dpkg's status file with every package installed at OLD."""
    entries = []
    for name in binary_packages():
        text = control_text(name, OLD)
        entries.append(text.replace(f"Package: {name}\n",
                                    f"Package: {name}\nStatus: install ok installed\n"))
    return "\n".join(entries) + "\n"


def test_apt_unpacks_the_role_packages_before_kibotos_common(tmp_path: Path) -> None:
    """`apt install ./*.deb` of the next version over the installed one, whatever the
    order of the arguments (kibotos-common first, last, in the middle): each role
    package is unpacked (its old prerm run) before kibotos-common is."""
    _need("apt-get", "dpkg-deb")
    debs = {name: build_stand_in(name, NEW, tmp_path) for name in binary_packages()}
    state = tmp_path / "state"
    (state / "lists/partial").mkdir(parents=True)
    (tmp_path / "cache/archives/partial").mkdir(parents=True)
    (state / "status").write_text(_status_of_old_versions())
    options = [f"Dir::State={state}", f"Dir::State::status={state / 'status'}",
               f"Dir::Cache={tmp_path / 'cache'}", "Dir::Etc::SourceList=/dev/null",
               "Dir::Etc::SourceParts=/dev/null", "Debug::NoLocking=1"]
    given = list(debs.values())
    orders = [given, given[::-1], given[1:3] + given[:1] + given[3:]]
    for order in orders:
        argv = ["apt-get", "-s", "-q", *itertools.chain(*(["-o", o] for o in options)),
                "install", *(f"./{d.name}" for d in order)]
        proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        unpacked = re.findall(r"^Inst (\S+) \[" + re.escape(OLD) + r"\]", proc.stdout, re.M)
        assert sorted(unpacked) == sorted(debs), proc.stdout
        assert unpacked[-1] == COMMON, (order, unpacked)


#: The stand-in role packages' prerm: what dpkg called it with, and the version of
#: kibotos-common installed at that moment (that is, whose binary a check would run).
RECORDING_PRERM = """#!/bin/sh
set -e
common=$(dpkg-query --admindir "$DPKG_ADMINDIR" -W -f='${Version}' kibotos-common)
echo "$DPKG_MAINTSCRIPT_PACKAGE $* common=$common" >> "$DPKG_ROOT/prerm.log"
"""


def _dpkg_root(tmp: Path) -> list[str]:
    """dpkg on an empty private root in `tmp/root` (made afresh)."""
    root = tmp / "root"
    if root.exists():
        shutil.rmtree(root)
    for d in ("var/lib/dpkg/updates", "var/lib/dpkg/info", "var/log"):
        (root / d).mkdir(parents=True)
    for f in ("var/lib/dpkg/status", "var/lib/dpkg/available"):
        (root / f).touch()
    dpkg = ["dpkg", f"--root={root}", "--force-script-chrootless", "--force-not-root",
            f"--log={root / 'var/log/dpkg.log'}"]
    return dpkg


def _debs(tmp: Path, version: str) -> dict[str, Path]:
    out = tmp / version
    out.mkdir()
    return {name: build_stand_in(name, version, out,
                                 {} if name == COMMON else {"prerm": RECORDING_PRERM})
            for name in binary_packages()}


def test_dpkg_never_unpacks_kibotos_common_under_an_installed_role_package(
        tmp_path: Path) -> None:
    """`dpkg -i` with kibotos-common first (no apt to order them): dpkg refuses to unpack
    it while the old role packages are installed, so their prerm still sees the old
    kibotos-common; with `--auto-deconfigure` (as apt calls dpkg) it first deconfigures
    them, calling `prerm deconfigure in-favour kibotos-common NEW` while the OLD one is
    installed, which is where kibotos-node's prerm checks in that order."""
    _need("dpkg", "dpkg-deb", "dpkg-query")
    old, new = _debs(tmp_path, OLD), _debs(tmp_path, NEW)
    common_first = [str(new[COMMON])] + [str(new[r]) for r in _roles()]
    log = tmp_path / "root/prerm.log"
    for auto_deconfigure in (False, True):
        dpkg = _dpkg_root(tmp_path)
        subprocess.run([*dpkg, "-i", *map(str, old.values())], check=True,
                       capture_output=True, timeout=120)
        extra = ["--auto-deconfigure"] if auto_deconfigure else []
        proc = subprocess.run([*dpkg, *extra, "-i", *common_first], capture_output=True,
                              text=True, timeout=120, check=False)
        calls = log.read_text().splitlines()
        if not auto_deconfigure:
            assert proc.returncode != 0
            assert f"installing {COMMON} would break" in proc.stderr, proc.stderr
            assert sorted(calls) == sorted(f"{r} upgrade {NEW} common={OLD}"
                                           for r in _roles()), calls
            continue
        assert proc.returncode == 0, proc.stdout + proc.stderr
        for role in _roles():
            deconfigure = f"{role} deconfigure in-favour {COMMON} {NEW} common={OLD}"
            assert deconfigure in calls, calls
            assert calls.index(deconfigure) < calls.index(f"{role} upgrade {NEW} "
                                                          f"common={NEW}"), calls
