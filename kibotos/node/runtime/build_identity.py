"""What a node build says about itself where upgrades are concerned, and the release
lines the spec's upgrade rules are written in.

A build is its release version (`kibotos._version.__version__`), the guest protocol
versions it accepts (`kibotos.guest.ACCEPTED_PROTOCOL_VERSIONS`), the guest
capabilities its agent declares and the record format versions it reads.  Every
upgrade decision (which runtime installations a node can still drive, what
`check-upgrade` reports) takes a `BuildIdentity` instead of reading
those constants, so a test can stand for release N and then N+1 in one process
(``BuildIdentity(release="0.4.0")``, then ``"0.4.1"``) while production code only ever
uses `current()`, which is the constants of the installed build: there is no switch a
production node reads to pretend it is another release.

Release lines (spec: node-and-vmm-processes, "Data-plane processes" and "Launch records
and adoption"): a final release ``MAJOR.MINOR.PATCH`` is on the release line
``MAJOR.MINOR``; a pre-release (``a``/``b``/``rc``), a dev build or ``unreleased`` is on
a line of its own, shared only with exactly the same version.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kibotos import _version
from kibotos.guest import ACCEPTED_PROTOCOL_VERSIONS
from kibotos.guest.kibotos_guest import CAPABILITIES
from kibotos.node.records import instance_records as records

_FINAL = re.compile(r"(\d+)\.(\d+)\.(\d+)")
#: Format of ``pki/identity.json`` (the node identity and the enrollment record it
#: carries); files written before the field existed are format 1.
IDENTITY_FORMAT = 1


@dataclass(frozen=True)
class BuildIdentity:
    """See the module docstring.  Ranges are inclusive ``(low, high)``."""

    release: str
    guest_protocols: tuple[int, int] = ACCEPTED_PROTOCOL_VERSIONS
    record_formats: tuple[int, int] = (records.FORMAT, records.FORMAT)
    identity_formats: tuple[int, int] = (IDENTITY_FORMAT, IDENTITY_FORMAT)
    #: What a guest of this build's agent declares; a running guest without some of
    #: them is adopted, and only the operations that need them fail.
    guest_capabilities: frozenset[str] = frozenset(CAPABILITIES)

    def reported_release(self) -> str:
        """The release the node reports to ctrl (``hello.release_version``): a dev
        build says ``unreleased``, as `kibotos._version.release_version` does."""
        return "unreleased" if ".dev" in self.release else self.release


def current() -> BuildIdentity:
    """This installed build."""
    return BuildIdentity(release=_version.__version__)


def final_release(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a final release; None for anything else."""
    match = _FINAL.fullmatch(version.strip())
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch)


def same_release_line(build_a: str, build_b: str) -> bool:
    """Whether two process builds (``<version>+<revision>``, `kibotos.source_build`) are
    on one release line: ``MAJOR.MINOR`` of final releases; anything else
    (pre-releases, development builds, ``unreleased``) only with exactly its version."""
    a, b = build_a.partition("+")[0], build_b.partition("+")[0]
    final_a, final_b = final_release(a), final_release(b)
    if final_a is None or final_b is None:
        return a == b
    return final_a[:2] == final_b[:2]


def runtime_range_problem(runtime_version: str, build: BuildIdentity) -> str | None:
    """Why a runtime pinned by release `runtime_version` is outside what `build` can
    drive, or None when it is inside: the runtime `build` pins itself (same version),
    runtimes of earlier releases on the same release line, and those of the previous
    MINOR (spec: "Launch records and adoption")."""
    if runtime_version == build.release:
        return None
    here = final_release(build.release)
    there = final_release(runtime_version)
    if here is None or there is None:
        return (f"runtime version {runtime_version} is outside the range node release "
                f"{build.release} can drive: a pre-release, development or unreleased build "
                "drives only the runtime of exactly its own version")
    if there[:2] == here[:2] and there <= here:
        return None
    if there[0] == here[0] and there[1] == here[1] - 1:
        return None
    previous = f", and {here[0]}.{here[1] - 1}.x" if here[1] > 0 else ""
    line = f"{here[0]}.{here[1]}.0"
    own = build.release if line == build.release else f"{line} to {build.release}"
    return (f"runtime version {runtime_version} is outside the range node release "
            f"{build.release} can drive ({own}{previous})")


def in_range(value: int, bounds: tuple[int, int]) -> bool:
    low, high = bounds
    return low <= value <= high
