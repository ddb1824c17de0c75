"""``kibotos-node check-maintenance --operation upgrade|remove``: are this node's
resources quiescent and owned, so that its binary can be replaced or removed?

Spec (node-and-vmm-processes, "Pre-replacement check: check-maintenance"), run after
the node service stopped, with the owner lock held (read-only: `ReadOnlyOwnerLock`):

* ``upgrade``: Instances may keep running when each one's launch record matches its
  actual service (unit name, InvocationID, MainPID, start time, executable path and
  dev:ino, cgroup, network namespace) and no launch, stop or network switch is half
  done (states CREATING and STOPPING; a RUNNING record without the service facts; a
  network record with a pending policy, `kibotos.node.checks.network_check`).  Detached
  Volumes and retained layers may stay.
* ``remove``: no Instance at all, no Volume or retained layer held by this node.
* both: no leftovers without an owner (an Instance directory without a readable
  record, a VMM service no record names, a mount, network record or network namespace
  not of an Instance,
  an entry of a pool's ``volumes/transfer-staging/`` that is not a temporary file, a
  Firecracker sandbox that is not a root-only tmpfs of Instances, an attachment record
  in ``runtime/storage-pools/`` naming an Instance with no record), no helper process
  still working in the storage root or a pool, no corrupted record.

What may stay: configuration, ``pki/``, ``installations/``, ``template-cache/``,
temporary files of interrupted writes (dot-files), objects whose holder is another
node.  Data-plane and egress processes are neither checked nor ended.  `check` is the
part `kibotos.node.checks.upgrade_check` repeats after a shutdown.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kibotos.backends import Supervisor, UnitInfo
from kibotos.config import NodeConfig
from kibotos.core.errors import FailedPrecondition
from kibotos.node.checks.check_report import (
    ReadOnlyOwnerLock,
    Report,
    RuntimeInUse,
    ancestors,
    mentions,
    mounts,
    processes,
    under,
)
from kibotos.node.checks.network_check import check_network
from kibotos.node.host.layout import NodePaths
from kibotos.node.instances.adoption import owns_unit
from kibotos.node.instances.contract import CREATING, FAILED, RUNNING, STOPPING
from kibotos.node.instances.setup import supervisor_options
from kibotos.node.records import instance_records as records
from kibotos.node.records.attachments import Attachments
from kibotos.node.storage.objects import KINDS, RETAINED_LAYERS, PoolObjects
from kibotos.plugins import Registries, load_plugins

OPERATIONS = ("upgrade", "remove")
VMM_PREFIX = "kibotos-vmm-"
#: Units the node starts that the checks leave alone (spec: neither operation checks
#: or ends data-plane processes; egress processes are the same kind).
UNCHECKED_PREFIXES = ("kibotos-dataplane-", "kibotos-egress-")
#: The spec's default shared sandbox root of the Firecracker backend.
DEFAULT_CHROOT_BASE = "/srv/jailer"
_FIELDS = (("unit name", "unit_name"), ("InvocationID", "invocation_id"),
           ("PID", "main_pid"), ("start time", "start_time_ticks"),
           ("executable path", "executable"), ("executable dev:ino", "executable_dev_ino"),
           ("cgroup", "cgroup"), ("network namespace", "netns_inode"))


@dataclass
class InstanceView:
    """One Instance directory as the records and the supervisor show it."""

    instance_id: str
    dir: Path
    record: dict[str, Any] | None = None
    launch: dict[str, Any] | None = None
    unit: UnitInfo | None = None

    @property
    def state(self) -> str | None:
        return str(self.record["state"]) if self.record else None

    @property
    def unit_name(self) -> str | None:
        name = (self.record or {}).get("unit_name") or (self.launch or {}).get("unit_name")
        return str(name) if name else None


@dataclass
class Findings:
    """What the quiescence check learnt, for the upgrade check's further rules."""

    instances: list[InstanceView] = field(default_factory=list)


def mismatches(launch: Mapping[str, Any], info: UnitInfo) -> list[str]:
    """The facts in which the running service differs from its launch record."""
    unit = launch.get("unit") or {}
    actual = {"unit_name": info.name, "invocation_id": info.invocation_id,
              "main_pid": info.main_pid, "start_time_ticks": info.start_time_ticks,
              "executable": info.executable,
              "executable_dev_ino": list(info.executable_dev_ino)
              if info.executable_dev_ino else None,
              "cgroup": info.cgroup, "netns_inode": info.netns_inode}
    wanted = {**unit, "unit_name": launch.get("unit_name")}
    return [label for label, key in _FIELDS if wanted.get(key) != actual[key]]


def build_supervisor(config: NodeConfig, registries: Registries | None) -> Supervisor:
    regs = registries or load_plugins(config.plugins.disable)
    cls = regs.supervisor.get(config.supervisor.backend)
    supervisor: Supervisor = cls(supervisor_options(config))
    return supervisor


async def read_instances(paths: NodePaths, supervisor: Supervisor | None, report: Report
                         ) -> list[InstanceView]:
    """Every Instance directory with its records and its service (none without a
    `supervisor`); an unreadable record or a directory without one is a ``blocked:``
    line."""
    base = paths.runtime / "instances"
    try:
        dirs = sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))
    except FileNotFoundError:
        return []
    views = []
    for d in dirs:
        view = InstanceView(d.name, d)
        try:
            view.record = records.read_instance_record(d)
            view.launch = records.read_launch_record(d)
        except FailedPrecondition as exc:
            report.blocked(f"instance {d.name}: corrupted record: {exc.message}")
            continue
        if view.record is None:
            report.blocked(f"instance directory {d} has no Instance record: a leftover "
                           "with no owner")
            continue
        if view.unit_name and supervisor is not None:
            view.unit = await supervisor.describe(view.unit_name)
        views.append(view)
    return views


def _judge(view: InstanceView, operation: str, report: Report) -> None:
    iid, state, unit = view.instance_id, view.state, view.unit
    if operation == "remove":
        report.blocked(f"instance {iid} is active or requires cleanup (state {state}): "
                       "stop or delete its Workspace first")
        return
    if state in (CREATING, STOPPING):
        what = "launch" if state == CREATING else "stop"
        report.blocked(f"instance {iid} is active or requires cleanup: its {what} is half "
                       f"done (state {state}); start the node and let it finish")
        return
    if state not in (RUNNING, FAILED):
        report.blocked(f"instance {iid} requires cleanup: it ended (state {state}) but its "
                       "directory was not removed; start the node once, it removes it")
        return
    active = unit is not None and unit.active
    if state == FAILED and not active:
        report.ok(f"instance {iid} is FAILED and its VMM is gone; it keeps its objects "
                  "until its Workspace is stopped with --force")
        return
    launch = view.launch
    if launch is None or not isinstance(launch.get("unit"), dict):
        report.blocked(f"instance {iid} is active or requires cleanup: its launch record "
                       "lacks the service facts (the launch is half done)")
        return
    if not active or unit is None:
        report.blocked(f"instance {iid}: its record says {state} but its service "
                       f"{view.unit_name} is not running; start the node, it marks the "
                       "Instance FAILED")
        return
    diff = mismatches(launch, unit)
    if diff:
        report.blocked(f"instance {iid}: its launch record does not match service "
                       f"{unit.name}: {', '.join(diff)} differ; ownership is unclear")
        return
    report.ok(f"instance {iid} ({state}): service {unit.name} matches its launch record "
              f"(InvocationID {unit.invocation_id}, PID {unit.main_pid})")


async def check(config: NodeConfig, operation: str, report: Report, *,
                registries: Registries | None = None, proc_root: Path = Path("/proc")
                ) -> Findings:
    """The quiescence and ownership rules (the owner lock is the caller's)."""
    if operation not in OPERATIONS:
        raise FailedPrecondition(f"unknown operation {operation!r}: upgrade or remove")
    paths = NodePaths(config.storage.root)
    # No node ever ran on this storage root when it does not exist (the node creates it
    # first thing): it started no service, so the supervisor is not asked.  That lets
    # the package's prerm check a node that was installed and never started where no
    # systemd is booted (a chroot, piuparts).
    ever_ran = paths.root.exists()
    supervisor = build_supervisor(config, registries) if ever_ran else None
    views = await read_instances(paths, supervisor, report)
    for view in views:
        _judge(view, operation, report)
    if supervisor is not None:
        exempt = await _check_services(paths, supervisor, views, report)
    else:
        exempt = set()
        report.ok(f"no node ever ran on storage root {paths.root} (it does not exist): "
                  "no VMM service to check")
    owned = {v.instance_id for v in views}
    _check_helpers(config, exempt, report, proc_root)
    _check_host_leftovers(config, paths, owned, report, proc_root)
    _check_registry(paths, report)
    attached = _check_attachments(paths, views, report)
    _check_objects(config, views, operation, report, attached, ever_ran=ever_ran)
    return Findings(views)


async def _check_services(paths: NodePaths, supervisor: Supervisor,
                         views: list[InstanceView], report: Report) -> set[UnitInfo]:
    """VMM services no Instance record names; returns the running units whose
    processes may use the storage root (the Instances', data plane's, egress's)."""
    owned_units = {v.unit_name: v for v in views if v.unit_name}
    for info in await supervisor.list(VMM_PREFIX):
        if not owns_unit(info, supervisor, paths.runtime / "instances"):
            continue  # another node's VMM on this host (systemd's units are host-wide)
        if info.name not in owned_units:
            report.blocked(f"service {info.name} ({'running' if info.active else 'ended'}) "
                           "has no Instance record: a leftover with no owner")
    exempt = {v.unit for v in views if v.unit is not None and v.unit.active}
    for prefix in UNCHECKED_PREFIXES:
        exempt.update(u for u in await supervisor.list(prefix) if u.active)
    return exempt


def _check_helpers(config: NodeConfig, exempt: set[UnitInfo], report: Report,
                   proc_root: Path) -> None:
    bases = [config.storage.root, *(p.path for p in config.storage.pool)]
    mine = ancestors(proc_root)
    own_cgroup = next((p.cgroup for p in processes(proc_root) if p.pid == os.getpid()), None)
    pids = {u.main_pid for u in exempt if u.main_pid}
    cgroups = {u.cgroup for u in exempt if u.cgroup and u.cgroup != own_cgroup}
    found = False
    for proc in processes(proc_root):
        if proc.pid in mine or proc.pid in pids or proc.session in pids or \
                proc.pgid in pids or (proc.cgroup is not None and proc.cgroup in cgroups):
            continue
        base = mentions(proc, bases)
        if base is not None:
            found = True
            report.blocked(f"helper process {proc.pid} ({' '.join(proc.cmdline)[:120]}) is "
                           f"still running and uses {base}: wait for it to end")
    if not found:
        report.ok("no helper process works in the storage root or the pools")


def _check_host_leftovers(config: NodeConfig, paths: NodePaths, owned: set[str],
                          report: Report, proc_root: Path) -> None:
    instances = paths.runtime / "instances"
    bases = [config.storage.root, *(p.path for p in config.storage.pool)]
    table = mounts(proc_root)
    leftovers = 0
    for m in table:
        if not any(under(m.point, b) and m.point.rstrip("/") != str(b) for b in bases):
            continue
        if any(under(m.point, instances / iid) for iid in owned):
            continue
        leftovers += 1
        report.blocked(f"mount {m.point} ({m.fstype}) belongs to no Instance: a leftover "
                       "with no owner")
    leftovers += check_network(config, paths.root, owned, report)
    for pool in config.storage.pool:
        staging = pool.path / "volumes" / "transfer-staging"
        for entry in sorted(staging.iterdir()) if staging.is_dir() else []:
            if not entry.name.startswith("."):  # dot-files: interrupted writes
                leftovers += 1
                report.blocked(f"staging entry {entry} belongs to no running command: a "
                               "leftover with no owner")
    if config.vmm.backend == "firecracker":
        leftovers += _check_sandbox(config, owned, table, report)
    if not leftovers:
        report.ok("every mount, network record, network namespace and staging entry "
                  "belongs to an owner, and no network switch is half done")


def _check_sandbox(config: NodeConfig, owned: set[str], table: list[Any],
                   report: Report) -> int:
    """The shared Firecracker sandbox root may stay only as a root-owned 0700 tmpfs
    holding nothing but directories of the node's Instances."""
    base = Path(str(config.vmm.options().get("chroot_base_dir", DEFAULT_CHROOT_BASE)))
    try:
        st = base.lstat()
    except FileNotFoundError:
        return 0
    problems = []
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or stat.S_IMODE(st.st_mode) != 0o700:
        problems.append("it is not a directory owned by root with mode 0700")
    if not any(m.point.rstrip("/") == str(base).rstrip("/") and m.fstype == "tmpfs"
               for m in table):
        problems.append("it is not a tmpfs")
    for exe in sorted(base.iterdir()) if base.is_dir() else []:
        for jail in sorted(exe.iterdir()) if exe.is_dir() else [exe]:
            if jail.name not in owned:
                problems.append(f"{jail} belongs to no Instance")
    for problem in problems:
        report.blocked(f"sandbox root {base}: {problem}")
    return len(problems)


def _check_registry(paths: NodePaths, report: Report) -> None:
    registry = paths.runtime / "registry"
    for entry in sorted(registry.glob("*.json")) if registry.is_dir() else []:
        if entry.name.startswith("."):
            continue
        try:
            records.read_registry_entry(registry, entry.name[:-5])
        except FailedPrecondition as exc:
            report.blocked(f"ended-instance record {entry.name}: corrupted record: "
                           f"{exc.message}")


def _check_attachments(paths: NodePaths, views: list[InstanceView], report: Report
                       ) -> set[tuple[str, str, str]]:
    """This node's attachment records (``runtime/storage-pools/``): one whose Instance
    has no record here is a leftover with no owner, an unreadable one a corrupted
    record.  Returns the objects attached by a record with an owner."""
    scan = Attachments(paths.root).scan()
    owned = {v.instance_id for v in views}
    attached: set[tuple[str, str, str]] = set()
    for key, why in sorted(scan.unreadable.items()):
        report.blocked(f"attachment record of {key[1]} {key[2]} in storage pool {key[0]}: "
                       f"corrupted record: {why}")
    for att in scan.found:
        if att.instance_id in owned:
            attached.add(att.key)
            continue
        report.blocked(f"attachment record {Attachments(paths.root).path(*att.key)} names "
                       f"Instance {att.instance_id}, which has no record on this node: a "
                       "leftover with no owner")
    return attached


def _check_objects(config: NodeConfig, views: list[InstanceView], operation: str,
                   report: Report, attached: set[tuple[str, str, str]], *,
                   ever_ran: bool = True) -> None:
    """`attached`: by the attachment records; an Instance record's ``held`` counts too
    (records of a node from before attachment records; its next start writes them).
    A pool that is not there blocks a removal only when a node ever ran on this storage
    root: one installed and never started (the package's example pool is never made)
    cannot have put anything into it."""
    attached = attached | {(str(h.get("pool_id")), str(h.get("kind")),
                            str(h.get("object_id")))
                           for v in views for h in (v.record or {}).get("held") or []
                           if isinstance(h, dict)}
    detached: list[tuple[str, str, str]] = []
    for pool in config.storage.pool:
        if not pool.path.is_dir():
            text = f"storage pool {pool.id}: {pool.path} is not there; its objects cannot " \
                   "be checked"
            if operation == "remove" and ever_ran:
                report.blocked(text)
            elif operation == "remove":
                report.ok(text + " (no node ever ran on this storage root)")
            else:
                report.ok(text + " (objects may stay for an upgrade)")
            continue
        for kind in KINDS:
            objects = PoolObjects(pool.id, pool.path, kind, config.node.id)
            detached += [(pool.id, kind, ref) for ref in objects.held_by_me()
                         if (pool.id, kind, ref) not in attached]
    if operation == "remove":
        for pool_id, kind, ref in detached:
            what = "retained layer" if kind == RETAINED_LAYERS else "detached volume"
            report.blocked(f"{what} {ref} in storage pool {pool_id} is held by this node: "
                           "delete its Workspace or Volume first")
        if not detached:
            report.ok("no Volume or retained layer is held by this node")
    elif detached:
        report.ok(f"{len(detached)} detached Volumes and retained layers stay held by this "
                  "node (allowed for an upgrade)")


async def run(config: NodeConfig, operation: str, *, registries: Registries | None = None,
              proc_root: Path = Path("/proc")) -> Report:
    """The whole check under the owner lock; the report (its `exit_code` is the
    command's)."""
    report = Report()
    try:
        with ReadOnlyOwnerLock(NodePaths(config.storage.root).lock_file):
            await check(config, operation, report, registries=registries,
                        proc_root=proc_root)
    except RuntimeInUse as exc:
        report.blocked(str(exc))
    return report
