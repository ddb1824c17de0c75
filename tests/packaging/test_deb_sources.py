"""Fast checks of the Debian packaging sources (no build; the build and the package are
tests/packaging/test_deb.py): what would otherwise fail only minutes into a
`make deb`, or only on an operator's host."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SCRIPTS = sorted(str(p.relative_to(REPO)) for p in (REPO / "debian").iterdir()
                 if p.suffix in (".postinst", ".prerm", ".postrm", ".preinst"))
SCRIPTS += ["debian/build-venv.sh", "debian/completions.sh", "packaging/deb/build.sh"]
#: The binary packages by role (docs/packaging.md), in debian/control's order.
PACKAGES = ["kibotos-common", "kibotos-node", "kibotos-ctrl", "kibotos-cli",
            "kibotos-e2b-gateway", "kibotos-exposure-gateway"]
GATEWAYS = ["kibotos-e2b-gateway", "kibotos-exposure-gateway"]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "packaging/deb/requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"not an exact pin: {line!r}"
            pins[canonicalize_name(name)] = version
    return pins


def test_every_runtime_dependency_is_pinned_in_a_matching_version() -> None:
    """debian/rules installs with `pip --no-index` from the pinned wheels only: a
    dependency pyproject.toml gains without a pin here breaks the package build."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for r in project["optional-dependencies"]["postgresql"]]
    for pyproject in REPO.glob("plugins/*/pyproject.toml"):
        deps = tomllib.loads(pyproject.read_text())["project"].get("dependencies", [])
        wanted += [Requirement(r) for r in deps
                   if not canonicalize_name(Requirement(r).name).startswith("kibotos")]
    pins = _pins()
    for req in wanted:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not pinned in packaging/deb/requirements.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])
        for extra in req.extras:          # psycopg[binary] -> psycopg-binary
            assert canonicalize_name(f"{req.name}-{extra}") in pins, req
    assert "setuptools" in pins       # the build of kibotos and its plugins


def test_changelog_version_is_the_release_version() -> None:
    from kibotos._version import __version__
    first = (REPO / "debian/changelog").read_text().splitlines()[0]
    match = re.match(r"kibotos \(([^)]+)\) ", first)
    assert match, first
    debian = re.sub(r"\.?(dev|a|b|rc)(\d+)$", r"~\1\2", __version__)
    assert match.group(1) == debian, "add a debian/changelog entry for the new version"


def test_the_packages_by_role() -> None:
    control = (REPO / "debian/control").read_text()
    assert re.findall(r"^Package: (\S+)$", control, re.M) == PACKAGES
    # Only the node package runs maintainer checks and makes the accounts.
    assert "useradd" in (REPO / "debian/kibotos-node.postinst").read_text()
    assert not (REPO / "debian/kibotos-ctrl.postinst").exists()


def test_every_unit_file_is_shipped_and_no_slice_is_handled_by_debhelper() -> None:
    """Each file of contrib/systemd is installed by exactly one package: the slices and
    the node's unit by kibotos-node, each other service by its role's package."""
    node = (REPO / "debian/kibotos-node.install").read_text()
    assert "contrib/systemd/*.slice lib/systemd/system/" in node
    services = {"kibotos-node": "kibotos-node.service", "kibotos-ctrl": "kibotos-ctrl.service",
                **{gateway: f"{gateway}.service" for gateway in GATEWAYS}}
    for package, unit in services.items():
        install = (REPO / f"debian/{package}.install").read_text()
        assert f"contrib/systemd/{unit} lib/systemd/system/" in install, package
    shipped = {p.name for p in (REPO / "contrib/systemd").iterdir()}
    assert shipped == set(services.values()) | {
        p.name for p in (REPO / "contrib/systemd").glob("*.slice")}
    rules = (REPO / "debian/rules").read_text()
    calls = [c.split("\n\n", 1)[0] for c in rules.split("dh_installsystemd -p")[1:]]
    assert sorted(c.split()[0] for c in calls) == sorted(services), calls
    for call in calls:
        assert ".slice" not in call
        assert "--no-enable" in call
        assert "--no-start" in call


def test_the_gateways_share_their_maintainer_scripts() -> None:
    """One prerm and one postrm serve every gateway package (they read the package's
    name from dpkg), and the postrm knows each gateway's credential file."""
    postrm = (REPO / "debian/gateway.postrm").read_text()
    for gateway in GATEWAYS:
        for script in ("prerm", "postrm"):
            link = REPO / f"debian/{gateway}.{script}"
            assert link.is_symlink(), link
            assert os.readlink(link) == f"gateway.{script}", link
        kind = gateway.removeprefix("kibotos-").removesuffix("-gateway")
        assert f"{gateway}) credential=/etc/kibotos/gateway-{kind}.credential" in postrm


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse_and_pass_shellcheck(script: str) -> None:
    path = REPO / script
    shell = "bash" if path.read_text().startswith("#!/usr/bin/env bash") else "sh"
    subprocess.run([shell, "-n", str(path)], check=True)
    if shutil.which("shellcheck") is None:
        if IN_CI:
            pytest.fail("shellcheck missing (packaging/apt-test-deps.txt)")
        pytest.skip("shellcheck not installed")
    proc = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stdout
