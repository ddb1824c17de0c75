"""Find the Debian mirror this machine's apt uses, for debootstrap.

The machines have no internet but the package registries, so debootstrap must use the
same mirror apt does.  Both source formats are read: one-line ``.list`` files and
deb822 ``.sources`` files.  The mirror is the first ``deb`` entry for component
``main`` whose suite is a plain release name (not ``-security``/``-updates``), which
is the archive debootstrap expects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kibotos.core.errors import FailedPrecondition


@dataclass(frozen=True)
class Source:
    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]


def _parse_list(text: str) -> list[Source]:
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        words = line.split()
        if not words or words[0] != "deb":
            continue
        words = words[1:]
        if words and words[0].startswith("["):
            while words and not words[0].endswith("]"):
                words = words[1:]
            words = words[1:]
        if len(words) >= 3:
            out.append(Source(words[0].rstrip("/"), (words[1],), tuple(words[2:])))
    return out


def _parse_deb822(text: str) -> list[Source]:
    out = []
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = ""
        for line in stanza.splitlines():
            if line.startswith("#"):
                continue
            if line[:1].isspace() and key:
                fields[key] += " " + line.strip()
                continue
            key, sep, value = line.partition(":")
            if not sep:
                key = ""
                continue
            key = key.strip().lower()
            fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split():
            continue
        if fields.get("enabled", "yes").lower() == "no":
            continue
        for uri in fields.get("uris", "").split():
            out.append(Source(uri.rstrip("/"), tuple(fields.get("suites", "").split()),
                              tuple(fields.get("components", "").split())))
    return out


def apt_sources(etc_apt: Path = Path("/etc/apt")) -> list[Source]:
    sources: list[Source] = []
    main = etc_apt / "sources.list"
    if main.is_file():
        sources += _parse_list(main.read_text())
    parts = etc_apt / "sources.list.d"
    if parts.is_dir():
        for f in sorted(parts.iterdir()):
            if f.suffix == ".list":
                sources += _parse_list(f.read_text())
            elif f.suffix == ".sources":
                sources += _parse_deb822(f.read_text())
    return sources


def debian_mirror(suite: str, etc_apt: Path = Path("/etc/apt")) -> str:
    """The mirror URI for `suite` (e.g. ``bookworm``) from apt's configuration."""
    for src in apt_sources(etc_apt):
        if suite in src.suites and "main" in src.components:
            return src.uri
    raise FailedPrecondition(
        f"no apt source for suite {suite!r} with component main in {etc_apt}; "
        "give the mirror explicitly (--mirror URL)")
