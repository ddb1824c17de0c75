"""debian/control read as data, and stand-in packages that carry exactly its relations
between the kibotos packages, for tests/packaging/test_package_ordering.py.

The stand-ins are real .deb files (``dpkg-deb -b``) with the binary packages' names
and their Depends / Pre-Depends / Breaks among the kibotos packages (``${binary:Version}``
filled in, the dependencies on Debian's packages left out), so that the real apt and
dpkg order an upgrade of them in seconds, without the package build."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The relation fields that order an unpack or a configuration (Debian Policy 7.2, 7.3).
ORDERING_FIELDS = ("Pre-Depends", "Depends", "Breaks")


def stanzas(control: Path = REPO / "debian/control") -> list[dict[str, str]]:
    """The paragraphs of a deb822 file (comment lines dropped, continuation lines
    joined with a space), in order."""
    paragraphs: list[dict[str, str]] = []
    current: dict[str, str] = {}
    field = ""
    for line in control.read_text().splitlines():
        if line.startswith("#"):
            continue
        if not line.strip():
            if current:
                paragraphs.append(current)
            current, field = {}, ""
        elif line[0] in " \t":
            current[field] += " " + line.strip()
        else:
            field, _, value = line.partition(":")
            current[field] = value.strip()
    if current:
        paragraphs.append(current)
    return paragraphs


def binary_packages() -> dict[str, dict[str, str]]:
    """Binary package name -> its paragraph of debian/control."""
    return {p["Package"]: p for p in stanzas() if "Package" in p}


def relations(paragraph: dict[str, str], field: str) -> list[str]:
    """The relations of `field` as written (``name (op version)``), substitution
    variables such as ``${misc:Depends}`` left out."""
    value = paragraph.get(field, "")
    return [r.strip() for r in value.split(",")
            if r.strip() and not r.strip().startswith("${")]


def kibotos_relations(paragraph: dict[str, str], field: str, version: str) -> list[str]:
    """The relations of `field` on kibotos packages, ``${binary:Version}`` = `version`."""
    return [r.replace("${binary:Version}", version) for r in relations(paragraph, field)
            if re.match(r"kibotos(-|\s|$)", r)]


def control_text(name: str, version: str, *, architecture: str = "all") -> str:
    """The control file of the stand-in for package `name` at `version`."""
    paragraph = binary_packages()[name]
    lines = [f"Package: {name}", f"Version: {version}", f"Architecture: {architecture}",
             "Maintainer: kibotos tests <tests@localhost>"]
    for field in ORDERING_FIELDS:
        found = kibotos_relations(paragraph, field, version)
        if found:
            lines.append(f"{field}: {', '.join(found)}")
    lines.append(f"Description: stand-in for {name} (tests/packaging)")
    return "\n".join(lines) + "\n"


def build_stand_in(name: str, version: str, out: Path,
                   scripts: dict[str, str] | None = None) -> Path:
    """A .deb of the stand-in (no files, the given maintainer scripts) in `out`."""
    tree = out / f"{name}_{version}"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN/control").write_text(control_text(name, version))
    for script, text in (scripts or {}).items():
        path = tree / "DEBIAN" / script
        path.write_text(text)
        path.chmod(0o755)
    deb = out / f"{name}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(tree), str(deb)],
                   check=True, capture_output=True, timeout=60)
    return deb
