"""Runtime installations: the files a node needs to drive the VMMs it launched, pinned
per Instance so that an upgraded node can still drive VMMs an earlier build started.

Spec (node-and-vmm-processes, "Launch records and adoption"): the launch record pins
the identity of the runtime installation the VMM uses; an installation lives in
``<storage.root>/installations/sha256-<identity>/`` and its ``installation.json``
describes it.  A new Instance always uses the installation of the current build; an
Instance an earlier build started keeps its recorded installation when the directory
is complete (every file's digest matches ``installation.json``) and its runtime
version is in the range the current build can drive
(`kibotos.node.runtime.build_identity.runtime_range_problem`).

What an installation holds (this codebase's choice).  A build's *runtime directory*
(`default_runtime_dir`: the directory that holds the installed ``kibotos`` package; a
package may ship the same layout elsewhere, e.g. ``/usr/lib/kibotos/node``) contains
the runtime pieces, copied into the installation under the same relative names:

* ``kibotos/guest/agent.py`` and ``kibotos/guest/kibotos_guest/**/*.py``: the guest agent
  this build installs in Templates and runs as the guest of a light VMM, which is the
  guest protocol the node speaks to its guests;
* the VMM executables a backend declares in ``RUNTIME_FILES`` (an optional member of
  `kibotos.backends.VmmBackend`: names relative to the runtime directory, e.g.
  ``bin/kibovm``); the built-in backends declare none (QEMU comes from the host's own
  package).

Files are copied (not hard-linked: an edit in place of a source file would change the
pinned copy too).  The runtime version is the release of the build that made the
installation; the identity is the sha256 of the canonical manifest (format, runtime
version, every file's digest), so two builds with the same pieces and version share
one installation.  The directory is built under a temporary name and renamed into
place; ``installation.json`` is written with `kibotos.core.atomicfile`.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kibotos
from kibotos.backends import VmmBackend
from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition
from kibotos.core.logs import EventLogger
from kibotos.node.records import instance_records as records
from kibotos.node.runtime.build_identity import BuildIdentity, runtime_range_problem

log = EventLogger()

FORMAT = 1
MANIFEST = "installation.json"
PREFIX = "sha256-"
#: The error an adoption reports for an Instance whose installation cannot be kept
#: (spec troubleshooting: ``recover instance process: ... compatible runtime
#: installation unavailable``).
UNAVAILABLE = "compatible runtime installation unavailable"
#: The node startup log record that gives the exact reason.
NOT_RETAINED_EVENT = "earlier runtime installation cannot be retained"
_TMP = ".tmp-"
_CHUNK = 1 << 20


def default_runtime_dir() -> Path:
    """The runtime directory of this installed build (see the module docstring)."""
    return Path(kibotos.__file__).resolve().parent.parent


def required_files(backend: VmmBackend | type[VmmBackend] | None = None) -> list[str]:
    """The relative names this build needs in a runtime directory: the guest agent and
    its package (as this build has them), and what `backend` (a VMM backend or its
    class) declares."""
    guest = Path(kibotos.__file__).resolve().parent / "guest"
    names = ["kibotos/guest/agent.py"]
    package = guest / "kibotos_guest"
    names += sorted(f"kibotos/guest/kibotos_guest/{p.relative_to(package).as_posix()}"
                    for p in package.rglob("*.py"))
    if backend is not None:
        names += [str(n) for n in backend.RUNTIME_FILES]
    return names


@dataclass(frozen=True)
class Installation:
    """One installation directory as its ``installation.json`` describes it."""

    identity: str            # "sha256-<hex>"
    path: Path
    runtime_version: str
    files: Mapping[str, str]  # relative name -> sha256 hex

    def launch_fields(self) -> dict[str, Any]:
        """What a launch record pins (``systemd.json`` ``installation``)."""
        return {"identity": self.identity, "runtime_version": self.runtime_version}


def installations_dir(root: Path) -> Path:
    return root / "installations"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def identity_of(runtime_version: str, files: Mapping[str, str]) -> str:
    canonical = json.dumps({"format": FORMAT, "runtime_version": runtime_version,
                            "files": dict(sorted(files.items()))},
                           sort_keys=True, separators=(",", ":"))
    return PREFIX + hashlib.sha256(canonical.encode()).hexdigest()


def check_identity(identity: object) -> str:
    """`identity` as a directory name; refuses anything that could leave the directory."""
    if not isinstance(identity, str) or not identity.startswith(PREFIX) or \
            len(identity) != len(PREFIX) + 64 or \
            any(c not in "0123456789abcdef" for c in identity[len(PREFIX):]):
        raise FailedPrecondition(f"runtime installation identity {identity!r} is not "
                                 "sha256-<64 hex digits>")
    return identity


def missing_files(runtime_dir: Path, names: Sequence[str]) -> list[str]:
    """The names of `names` that are not regular files in `runtime_dir`."""
    return [n for n in names if not (runtime_dir / n).is_file()]


def manifest_of(runtime_dir: Path, names: Sequence[str]) -> dict[str, str]:
    """Digest of every file; FailedPrecondition naming what the directory lacks."""
    missing = missing_files(runtime_dir, names)
    if missing:
        raise FailedPrecondition(f"runtime directory {runtime_dir} lacks {', '.join(missing)}")
    return {n: _digest(runtime_dir / n) for n in names}


def planned(runtime_dir: Path, build: BuildIdentity,
            backend: VmmBackend | type[VmmBackend] | None = None) -> tuple[str, dict[str, str]]:
    """The identity and manifest of the installation `build` would pin from
    `runtime_dir`, without writing anything (what `check-upgrade` compares with)."""
    files = manifest_of(runtime_dir, required_files(backend))
    return identity_of(build.release, files), files


# ---------------------------------------------------------------------------- reading


def read(root: Path, identity: str) -> Installation:
    """``installation.json`` of `identity`; FailedPrecondition when it is missing,
    unreadable or describes another identity."""
    path = installations_dir(root) / check_identity(identity)
    try:
        data = atomicfile.read_json(path / MANIFEST)
    except FileNotFoundError:
        raise FailedPrecondition(f"runtime installation {identity} is missing "
                                 f"({path / MANIFEST} does not exist)") from None
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(f"runtime installation {identity}: unreadable "
                                 f"{MANIFEST}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else None
        raise FailedPrecondition(f"runtime installation {identity}: {MANIFEST} has format "
                                 f"{got!r}; this node reads format {FORMAT}")
    files = data.get("files")
    version = data.get("runtime_version")
    if not isinstance(files, dict) or not isinstance(version, str) or not all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) for v in files.values()):
        raise FailedPrecondition(f"runtime installation {identity}: {MANIFEST} lacks "
                                 "runtime_version or file digests")
    digests = {str(k): str(v["sha256"]) for k, v in files.items()}
    if identity_of(version, digests) != identity:
        raise FailedPrecondition(f"runtime installation {identity}: {MANIFEST} describes "
                                 "another installation (its manifest does not hash to "
                                 "the directory's identity)")
    return Installation(identity, path, version, digests)


def verify(root: Path, identity: str) -> Installation:
    """The installation, after checking that every file it lists is there with its
    digest; FailedPrecondition naming the first missing or changed file."""
    inst = read(root, identity)
    for name, digest in sorted(inst.files.items()):
        path = inst.path / name
        try:
            got = _digest(path)
        except FileNotFoundError:
            raise FailedPrecondition(f"runtime installation {identity} is incomplete: "
                                     f"{name} is missing") from None
        except OSError as exc:
            raise FailedPrecondition(f"runtime installation {identity}: cannot read "
                                     f"{name}: {exc.strerror}") from None
        if got != digest:
            raise FailedPrecondition(f"runtime installation {identity} is corrupted: the "
                                     f"digest of {name} does not match {MANIFEST}")
    return inst


# ---------------------------------------------------------------------------- pinning


def pin(root: Path, build: BuildIdentity, *, runtime_dir: Path | None = None,
        backend: VmmBackend | type[VmmBackend] | None = None) -> Installation:
    """The current installation, made (or repaired) from `runtime_dir` if it is not
    complete on disk.  Called once at node start, under the owner lock."""
    source = runtime_dir or default_runtime_dir()
    identity, files = planned(source, build, backend)
    base = installations_dir(root)
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        return verify(root, identity)
    except FailedPrecondition as exc:
        if (base / identity).exists():
            log.warning("current runtime installation rebuilt", identity=identity,
                        problem=exc.message)
    tmp = base / f"{_TMP}{identity}-{secrets.token_hex(4)}"
    tmp.mkdir(mode=0o700)
    try:
        for name, digest in files.items():
            target = tmp / name
            target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            shutil.copy2(source / name, target)
            if _digest(target) != digest:
                raise FailedPrecondition(f"runtime directory {source}: {name} changed "
                                         "while it was copied")
            with open(target, "rb") as f:
                os.fsync(f.fileno())
        atomicfile.write_json(tmp / MANIFEST, {
            "format": FORMAT, "identity": identity, "runtime_version": build.release,
            "files": {n: {"sha256": d, "size": (tmp / n).stat().st_size}
                      for n, d in sorted(files.items())},
            "created_at": records.now_iso()}, mode=0o644)
        final = base / identity
        if final.exists():  # incomplete or corrupted: replaced as a whole
            trash = base / f"{_TMP}old-{identity}-{secrets.token_hex(4)}"
            final.rename(trash)
            shutil.rmtree(trash, ignore_errors=True)
        tmp.rename(final)
        atomicfile.fsync_dir(base)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("runtime installation pinned", identity=identity, runtime_version=build.release)
    return verify(root, identity)


# ---------------------------------------------------------------------------- retaining


@dataclass(frozen=True)
class Retention:
    """Whether an Instance's recorded installation can be kept: `ok`, else `problem`
    (the exact reason) and `error` (the spec's short form for the Instance)."""

    identity: str | None
    ok: bool
    problem: str | None = None
    runtime_version: str | None = None

    @property
    def error(self) -> str | None:
        return None if self.ok else UNAVAILABLE


def assess(root: Path, recorded: object, current: Installation | str | None,
           build: BuildIdentity) -> Retention:
    """Whether a launch record's ``installation`` (`recorded`: ``{identity,
    runtime_version}`` or None) can be kept by `build`, whose own installation is
    `current` (an `Installation`, or only its identity).  Writes and logs nothing."""
    current_id = current.identity if isinstance(current, Installation) else current
    if not isinstance(recorded, dict) or "identity" not in recorded:
        return Retention(None, False, "the launch record pins no runtime installation")
    identity = recorded.get("identity")
    try:
        check_identity(identity)
        assert isinstance(identity, str)
        if identity == current_id:
            return Retention(identity, True, runtime_version=build.release)
        inst = verify(root, identity)
    except FailedPrecondition as exc:
        return Retention(identity if isinstance(identity, str) else None, False, exc.message)
    problem = runtime_range_problem(inst.runtime_version, build)
    return Retention(identity, problem is None, problem, inst.runtime_version)


def retain(root: Path, instance_id: str, recorded: object, current: Installation,
           build: BuildIdentity) -> Retention:
    """`assess` for a node taking over an Instance: a refusal is logged as the spec's
    startup record ``earlier runtime installation cannot be retained`` with the exact
    reason; the caller marks the Instance FAILED with `Retention.error` and leaves its
    VMM running (the directory is kept: `prune` keeps every recorded installation)."""
    verdict = assess(root, recorded, current, build)
    if not verdict.ok:
        log.error(NOT_RETAINED_EVENT, instance=instance_id, installation=verdict.identity,
                  reason=verdict.problem)
    return verdict


# ---------------------------------------------------------------------------- pruning


def recorded_identities(root: Path) -> set[str]:
    """Every installation a launch record under ``runtime/instances/`` pins, whatever
    the Instance's state (failed adoptions included); unreadable records are skipped
    here (startup deals with them)."""
    found: set[str] = set()
    base = root / "runtime" / "instances"
    try:
        dirs = [p for p in base.iterdir() if p.is_dir()]
    except FileNotFoundError:
        return found
    for d in dirs:
        try:
            launch = atomicfile.read_json(d / records.LAUNCH_RECORD)
        except (OSError, ValueError):
            continue
        pinned = launch.get("installation") if isinstance(launch, dict) else None
        if isinstance(pinned, dict) and isinstance(pinned.get("identity"), str):
            found.add(pinned["identity"])
    return found


def prune(root: Path, keep: Iterable[str]) -> list[str]:
    """Delete the installation directories (and interrupted builds) that neither `keep`
    nor any launch record names; the names deleted.  Run at node start after the
    Instances were taken over, so a failed adoption's installation stays."""
    base = installations_dir(root)
    kept = set(keep) | recorded_identities(root)
    removed: list[str] = []
    try:
        entries = sorted(base.iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.name in kept:
            continue
        if not entry.name.startswith((PREFIX, _TMP)):
            continue  # not ours: left alone
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    if removed:
        log.info("unused runtime installations deleted", count=len(removed),
                 installations=",".join(removed))
    return removed
