"""The ``nfs`` storage driver: a pool on an NFS export of a self-hosted server.

The node checks what it can see of the mount against spec/storage-pools-on-nfs.txt,
"Prerequisites" and "NFS versions", and refuses the pool (unavailable, with the rule in
the reason) rather than risk Workspace data on a mount that breaks the guarantees:

* the version is stated (``vers=3``, ``4.0``, ``4.1``, ``4.2``, or ``vers=4`` with a
  ``minorversion``): a negotiated version depends on both kernels;
* ``hard``: a soft mount turns a slow server into I/O errors inside guests;
* no ``nocto`` on a shared pool: a node taking over must read what the previous holder
  wrote, which close-to-open consistency gives;
* locks: a self-hosted nfsd provides NLM (v3) or in-protocol (v4) locks, so
  ``nolock`` / ``local_lock`` other than ``none`` are refused (`CloudNasRules` differ);
* then the writeback limit (`kibotos_nfs.writeback`).

The marker was checked by the node before `check` is called, so the writeback setting
only ever touches the mount of a real pool.  Nothing here touches the network.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kibotos.sdk import Availability, HostPaths, PoolSpec, StorageDriver, backend_options, procfs
from kibotos_nfs.mounts import NFS_TYPES, NfsMount, device_number
from kibotos_nfs.writeback import WritebackError, limit_dirty_pages

VERSIONS = ("3", "4.0", "4.1", "4.2")


def stated_version(mount: NfsMount) -> str | None:
    """The NFS version the options state, or None when it is left to negotiation."""
    vers = mount.value("vers") or mount.value("nfsvers")
    if vers is None:
        return None
    if vers == "4":
        minor = mount.value("minorversion")
        return f"4.{minor}" if minor is not None else None
    return vers


@dataclass(frozen=True)
class Verdict:
    problems: list[str]
    warnings: list[str]


class NfsDriver(StorageDriver):
    """`kibotos.sdk.StorageDriver` for a self-hosted NFS server."""

    name: ClassVar[str] = "nfs"
    #: Whether the server is a cloud provider's NAS (no NLM locks for v3).
    CLOUD: ClassVar[bool] = False

    def __init__(self, options: Mapping[str, Any]) -> None:
        backend_options("storage_driver", self.name, options)

    def lock_rules(self, mount: NfsMount, version: str, verdict: Verdict) -> None:
        """A self-hosted nfsd provides locks: neither ``nolock`` nor ``local_lock``."""
        if mount.has("nolock"):
            verdict.problems.append(
                "nolock is set, but a self-hosted NFS server provides locks: remove it (a "
                "cloud provider's NAS without NLM locks uses driver cloud-nas)")
        local_lock = mount.value("local_lock")
        if local_lock not in (None, "none"):
            verdict.problems.append(f"local_lock={local_lock} is set: remove it, the "
                                    "server's locks must be used")

    def judge(self, mount: NfsMount, shared: bool) -> Verdict:
        verdict = Verdict([], [])
        version = stated_version(mount)
        if version is None:
            verdict.problems.append(
                "the NFS version is not stated in the mount options: mount with vers=4.2, "
                "vers=4.1, vers=4.0 or vers=3, not by negotiation")
        elif version not in VERSIONS:
            verdict.problems.append(f"NFS version {version} is not supported (use 4.2, "
                                    "4.1, 4.0 or 3)")
        if mount.has("soft") or mount.has("softerr") or not mount.has("hard"):
            verdict.problems.append("the mount is not hard: add hard to the mount options")
        if shared and mount.has("nocto"):
            verdict.problems.append(
                "nocto is set on a shared pool: a node taking over could read stale "
                "records; remove it")
        if mount.has("ro"):
            verdict.problems.append("the mount is read-only")
        if version in VERSIONS:
            self.lock_rules(mount, version, verdict)
        return verdict

    def check(self, pool: PoolSpec, host: HostPaths) -> Availability:
        where = f"pool {pool.id}: {pool.path}"
        if not pool.path.is_dir():
            return Availability(False, f"{where} does not exist (is the pool mounted?)")
        try:
            mounts = procfs.read_mounts(host.proc_root)
        except OSError as exc:
            return Availability(False, f"{where}: cannot read "
                                f"{procfs.mounts_file(host.proc_root)}: {exc.strerror or exc}")
        real = os.path.realpath(pool.path)
        mount = procfs.find_mount(mounts, real)
        if mount is None or mount.fstype not in NFS_TYPES:
            found = f"{mount.fstype} mount {mount.mount_point}" if mount else "no mount"
            return Availability(False, f"{where} is not on an NFS mount ({found}; driver "
                                f"{self.name} needs the pool directory on NFS)")
        verdict = self.judge(mount, pool.shared)
        if verdict.problems:
            return Availability(False, f"{where}: NFS mount {mount.mount_point} "
                                f"({mount.device}): " + "; ".join(verdict.problems))
        device = device_number(host.proc_root, mount, pool.path)
        try:
            limit_dirty_pages(host.sys_root, device, f"{where}: NFS mount "
                              f"{mount.mount_point}")
        except WritebackError as exc:
            return Availability(False, str(exc))
        return Availability(True, warnings=tuple(
            f"{where}: NFS mount {mount.mount_point}: {w}" for w in verdict.warnings))
