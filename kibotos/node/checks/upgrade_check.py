"""``kibotos-node check-upgrade --runtime-dir DIR [--preview]``, run with the *target*
build's binary: can this build take over what the running one leaves on disk?

Spec (node-and-vmm-processes, "Checking with the target binary before replacement" and
"Previewing with --preview").  After the shutdown (owner lock held, read-only) it runs
the quiescence rules of ``check-maintenance --operation upgrade``
(`kibotos.node.checks.maintenance_check.check`) and four more:

1. the format versions of the node identity, the enrollment record and the launch
   records (``systemd.json``, ``instance.json``, ended-Instance records) are in the
   ranges this build reads;
2. the target runtime directory holds the runtime files this build requires
   (`kibotos.node.runtime.installations.required_files`);
3. every running Instance's runtime installation can be kept: it is the one this
   build will pin from that directory, or it is complete and its runtime version is in
   the range this build drives (an earlier installation is reported, not blocking);
4. every running guest answers ``GuestInfo`` through its own VMM with a protocol
   version this build accepts; capabilities this build's agent has and the guest lacks
   are listed, not blocking.

``--preview`` runs on a live node: no owner lock, no quiescence rules, only 1-4;
what the node is still working on (an Instance starting or stopping, a launch record
without its service facts, a guest that did not answer) is ``pending:``.  Nothing is
written either way: records are read as JSON, the installation is only planned, and a
guest gets nothing but the hello request.  `build` stands for this build
(`kibotos.node.runtime.build_identity.current`) unless a test passes another release.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from kibotos.backends import VmmBackend
from kibotos.config import NodeConfig
from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition, KibotosError
from kibotos.guest import open_guest_channel
from kibotos.node.checks import maintenance_check
from kibotos.node.checks.check_report import ReadOnlyOwnerLock, Report, RuntimeInUse
from kibotos.node.host.layout import NodePaths
from kibotos.node.instances.contract import CREATING, RUNNING, STOPPING
from kibotos.node.records import instance_records as records
from kibotos.node.runtime import installations
from kibotos.node.runtime.build_identity import BuildIdentity, current, in_range
from kibotos.plugins import Registries, load_plugins
from kibotos.vmm_ready import first_kibotos_error

#: How long a guest gets to answer GuestInfo.
GUEST_TIMEOUT = 10.0
_ANY_PROTOCOL = (0, 2**31 - 1)
PREVIEW_NOTE = ("--preview does not evaluate quiescence or ownership: helper processes, "
                "leftovers with no owner, host mounts, staging directories and the "
                "ownership of Volumes and writable layers are not part of this result; "
                "before the replacement stop the node service and run check-upgrade "
                "without --preview")


def _read_json(path: Path) -> dict[str, Any] | None:
    return atomicfile.read_json_object_if_present(
        path, lambda exc: f"{path}: unreadable: {exc}", f"{path}: not a JSON object")


def _fmt(bounds: tuple[int, int]) -> str:
    return str(bounds[0]) if bounds[0] == bounds[1] else f"{bounds[0]} to {bounds[1]}"


def check_formats(paths: NodePaths, build: BuildIdentity, report: Report
                  ) -> dict[str, tuple[dict[str, Any], dict[str, Any] | None]]:
    """Rule 1; returns the Instances whose records this build can read: ``{id:
    (instance.json, systemd.json or None)}``."""
    identity = paths.identity_file
    try:
        data = _read_json(identity)
    except FailedPrecondition as exc:
        report.blocked(f"node identity: {exc.message}")
        data = None
    else:
        if data is None:
            report.ok("node identity: none yet (the node enrolls at its first start)")
    if data is not None:
        fmt = data.get("format", 1)  # written before the field existed: format 1
        for what in ("node identity", "enrollment record"):
            if isinstance(fmt, int) and in_range(fmt, build.identity_formats):
                report.ok(f"{what} {identity}: format {fmt} (this version reads "
                          f"{_fmt(build.identity_formats)})")
            else:
                report.blocked(f"{what} {identity}: format {fmt!r} is outside what this "
                               f"version reads ({_fmt(build.identity_formats)})")
    readable: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {}
    count = bad = 0
    base = paths.runtime / "instances"
    dirs = sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")) \
        if base.is_dir() else []
    registry = paths.runtime / "registry"
    entries = sorted(p for p in registry.glob("*.json") if not p.name.startswith(".")) \
        if registry.is_dir() else []
    files = [(d.name, d / records.INSTANCE_RECORD) for d in dirs] + \
        [(d.name, d / records.LAUNCH_RECORD) for d in dirs] + [("", p) for p in entries]
    loaded: dict[Path, dict[str, Any] | None] = {}
    for _, path in files:
        try:
            value = _read_json(path)
        except FailedPrecondition as exc:
            bad += 1
            report.blocked(f"record {exc.message}")
            continue
        loaded[path] = value
        if value is None:
            continue
        count += 1
        fmt = value.get("format")
        if not isinstance(fmt, int) or not in_range(fmt, build.record_formats):
            bad += 1
            loaded[path] = None
            report.blocked(f"record {path}: format {fmt!r} is outside what this version "
                           f"reads ({_fmt(build.record_formats)})")
    for d in dirs:
        rec = loaded.get(d / records.INSTANCE_RECORD)
        if rec is not None and (d / records.LAUNCH_RECORD) in loaded:
            readable[d.name] = (rec, loaded[d / records.LAUNCH_RECORD])
    if not bad:
        report.ok(f"{count} launch, Instance and ended-Instance records: formats this "
                  f"version reads ({_fmt(build.record_formats)})")
    return readable


def check_runtime_dir(runtime_dir: Path, build: BuildIdentity,
                      backend: VmmBackend | type[VmmBackend], report: Report) -> str | None:
    """Rule 2; the identity of the installation this build would pin, if complete."""
    if not runtime_dir.is_dir():
        report.blocked(f"target runtime directory {runtime_dir} does not exist")
        return None
    names = installations.required_files(backend)
    missing = installations.missing_files(runtime_dir, names)
    if missing:
        report.blocked(f"target runtime directory {runtime_dir} lacks {', '.join(missing)}")
        return None
    identity, _ = installations.planned(runtime_dir, build, backend)
    report.ok(f"target runtime directory {runtime_dir} has the {len(names)} runtime files "
              f"this version requires (installation {identity}, runtime version "
              f"{build.release})")
    return identity


def check_installation(paths: NodePaths, iid: str, launch: dict[str, Any],
                       target: str | None, build: BuildIdentity, report: Report) -> None:
    """Rule 3 for one running Instance."""
    recorded = launch.get("installation")
    ident = recorded.get("identity") if isinstance(recorded, dict) else None
    if target is not None and ident == target:
        report.ok(f"instance {iid}: runtime installation {ident} is the one this version "
                  "uses")
        return
    verdict = installations.assess(paths.root, recorded, target, build)
    if verdict.ok:
        report.ok(f"instance {iid}: uses earlier runtime installation {verdict.identity} "
                  f"(runtime version {verdict.runtime_version}); it keeps it, and switches "
                  f"to {target or 'this version installation'} on its next start")
    else:
        report.blocked(f"instance {iid}: runtime installation {verdict.identity or '-'} "
                       f"cannot be kept: {verdict.problem}; stop its Workspace normally "
                       "first (it starts again on this version's runtime)")


async def guest_info(backend: VmmBackend, launch: dict[str, Any]) -> Any:
    """The guest's hello through its own VMM (nothing else is sent)."""
    deadline = trio.current_time() + GUEST_TIMEOUT
    with trio.fail_after(GUEST_TIMEOUT + 1):
        stream = await backend.guest_channel(launch, timeout=GUEST_TIMEOUT)
        try:
            async with open_guest_channel(stream, accepted=_ANY_PROTOCOL) as channel:
                return await channel.wait_hello(deadline)
        except BaseExceptionGroup as group:
            found = first_kibotos_error(group)
            if found is None:
                raise
            raise found from None


async def check_guest(backend: VmmBackend, iid: str, launch: dict[str, Any],
                      build: BuildIdentity, preview: bool, report: Report) -> None:
    """Rule 4 for one running Instance."""
    try:
        info = await guest_info(backend, launch.get("launch") or {})
    except (KibotosError, OSError, trio.TooSlowError) as exc:
        text = (f"instance {iid}: the guest did not answer GuestInfo "
                f"({getattr(exc, 'message', None) or exc or type(exc).__name__})")
        if preview:
            report.pending(text + "; evaluated again after shutdown")
        else:
            report.blocked(text + "; a guest that cannot be asked cannot be checked")
        return
    low, high = build.guest_protocols
    if not low <= info.protocol_version <= high:
        report.blocked(f"instance {iid}: guest protocol version {info.protocol_version} is "
                       f"outside the range this version accepts ({_fmt((low, high))}); "
                       "stop its Workspace normally first")
        return
    lacking = sorted(build.guest_capabilities - set(info.capabilities))
    text = (f"instance {iid}: guest protocol version {info.protocol_version} (accepted "
            f"{_fmt((low, high))}), agent {info.agent_version}")
    if lacking:
        text += (f"; lacks capabilities {', '.join(lacking)}: it is adopted, operations "
                 "that use them fail until it restarts")
    report.ok(text)


async def _four(config: NodeConfig, runtime_dir: Path, build: BuildIdentity,
                preview: bool, registries: Registries, report: Report) -> None:
    paths = NodePaths(config.storage.root)
    readable = check_formats(paths, build, report)
    backend_cls = registries.vmm.get(config.vmm.backend)
    target = check_runtime_dir(runtime_dir, build, backend_cls, report)
    backend: VmmBackend = backend_cls(config.vmm.options())
    supervisor = maintenance_check.build_supervisor(config, registries)
    for iid, (rec, launch) in sorted(readable.items()):
        state = rec.get("state")
        if state in (CREATING, STOPPING):
            if preview:
                what = "starting" if state == CREATING else "stopping"
                report.pending(f"instance {iid} is {what}; evaluated again after shutdown")
            continue  # after a shutdown the quiescence rules already blocked it
        if state != RUNNING:
            continue
        if launch is None or not isinstance(launch.get("unit"), dict):
            if preview:
                report.pending(f"instance {iid}: its launch record is being written")
            continue
        info = await supervisor.describe(str(launch.get("unit_name") or ""))
        if info is None or not info.active:
            if preview:
                report.pending(f"instance {iid}: its service is not running (the node is "
                               "about to mark it FAILED)")
            continue
        check_installation(paths, iid, launch, target, build, report)
        await check_guest(backend, iid, launch, build, preview, report)


async def run(config: NodeConfig, runtime_dir: Path, *, preview: bool = False,
              build: BuildIdentity | None = None, registries: Registries | None = None,
              proc_root: Path = Path("/proc")) -> Report:
    """The whole check; the report (its `exit_code` is the command's)."""
    build = build or current()
    regs = registries or load_plugins(config.plugins.disable)
    report = Report()
    if preview:
        await _four(config, runtime_dir, build, True, regs, report)
        report.note(PREVIEW_NOTE)
        return report
    try:
        with ReadOnlyOwnerLock(NodePaths(config.storage.root).lock_file):
            await maintenance_check.check(config, "upgrade", report, registries=regs,
                                          proc_root=proc_root)
            await _four(config, runtime_dir, build, False, regs, report)
    except RuntimeInUse as exc:
        report.blocked(f"{exc}, or run check-upgrade with --preview")
    return report
