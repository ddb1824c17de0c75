"""Debian packages as build inputs: resolve, download and unpack them with apt's tools.

A build's cache key must be known before anything is downloaded, or an unchanged
rebuild would still fetch 70 MB of kernel.  apt's own index already carries each
candidate package's SHA256, so `resolve` answers "which exact file would I get" from
``apt-cache show`` alone, and `fetch` downloads only on a cache miss.  A metapackage
such as ``linux-image-amd64`` is followed to the one package it depends on.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kibotos.core.errors import FailedPrecondition, InvalidArgument

_FIELD = re.compile(r"^([A-Za-z0-9-]+):\s*(.*)$")


@dataclass(frozen=True)
class DebRef:
    """One exact package file: what apt would download, or a local .deb."""

    package: str
    version: str
    sha256: str
    path: Path | None = None  # set for a local file given by the caller

    def describe(self) -> dict[str, str]:
        return {"package": self.package, "version": self.version, "sha256": self.sha256}


def _run(argv: list[str], what: str, cwd: Path | None = None) -> str:
    try:
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise FailedPrecondition(f"{what}: {argv[0]} is not installed") from None
    if proc.returncode != 0:
        raise FailedPrecondition(
            f"{what}: {' '.join(argv)} exited with {proc.returncode}: {proc.stderr.strip()}"
        )
    return proc.stdout


def _show(packages: list[str]) -> dict[str, dict[str, str]]:
    """The candidate stanza of each package, by the name asked for (one apt call: apt
    rebuilds its cache on every run here, 0.6 s each)."""
    out = _run(["apt-cache", "show", "--no-all-versions", *packages],
               f"resolve packages {' '.join(packages)}")
    stanzas: list[dict[str, str]] = []
    fields: dict[str, str] = {}
    for line in [*out.splitlines(), ""]:
        if not line.strip():
            if fields:
                stanzas.append(fields)
            fields = {}
            continue
        m = _FIELD.match(line)
        if m:
            fields[m.group(1)] = m.group(2)
    by_name = {f.get("Package", ""): f for f in stanzas if "SHA256" in f}
    missing = [p for p in packages if p not in by_name]
    if missing:
        raise FailedPrecondition(f"resolve packages: apt knows no package {', '.join(missing)} "
                                 "(run apt-get update?)")
    return {p: by_name[p] for p in packages}


_EXACT_DEP = re.compile(r"\s*(linux-image-[a-z0-9.+-]+)\s*\(=\s*([^)]+)\)\s*")


def resolve(*packages: str) -> dict[str, DebRef]:
    """The candidate package file apt would download for each of `packages`.

    A ``linux-image-*`` metapackage (it has no files of its own and depends on exactly
    one exactly-versioned ``linux-image-*`` package, like Debian's ``linux-image-amd64``)
    resolves to the package it depends on."""
    shown = _show(list(packages))
    follow = {}
    for name, fields in shown.items():
        m = _EXACT_DEP.fullmatch(fields.get("Depends", ""))
        if name.startswith("linux-image-") and m and m.group(1) != name:
            follow[name] = m.group(1)
    if follow:
        targets = resolve(*sorted(set(follow.values())))
    refs = {}
    for name, fields in shown.items():
        if name in follow:
            refs[name] = targets[follow[name]]
        else:
            refs[name] = DebRef(fields["Package"], fields["Version"], fields["SHA256"])
    return refs


def local(path: Path) -> DebRef:
    """A .deb file the caller supplies (offline builds); named by its control fields."""
    if not path.is_file():
        raise InvalidArgument(f"package file {path} does not exist")
    out = _run(["dpkg-deb", "--show", "--showformat=${Package}\\n${Version}\\n", str(path)],
               f"read package file {path}")
    lines = out.splitlines()
    if len(lines) < 2:
        raise InvalidArgument(f"{path} is not a Debian package")
    return DebRef(lines[0], lines[1], sha256_file(path), path)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch(ref: DebRef, into: Path) -> Path:
    """The .deb file of `ref`, downloaded into `into` unless it is local; digest checked."""
    if ref.path is not None:
        return ref.path
    into.mkdir(parents=True, exist_ok=True)
    _run(["apt-get", "download", "-q", f"{ref.package}={ref.version}"],
         f"download package {ref.package}", cwd=into)
    matches = sorted(into.glob(f"{ref.package}_*.deb"))
    for candidate in matches:
        if sha256_file(candidate) == ref.sha256:
            return candidate
    raise FailedPrecondition(
        f"download package {ref.package}: no downloaded file has the expected sha256 "
        f"{ref.sha256} (found {[p.name for p in matches]})"
    )


def unpack(deb: Path, into: Path) -> Path:
    """Unpack the files of `deb` (not its maintainer scripts) under `into`."""
    into.mkdir(parents=True, exist_ok=True)
    _run(["dpkg-deb", "-x", str(deb), str(into)], f"unpack {deb.name}")
    return into
