"""Built-in storage-pool driver ``cloud-nas``: a pool on a cloud provider's NFS service.

The same checks as ``nfs`` (the version stated, ``hard``, no ``nocto`` on a shared pool,
the writeback limit), with the lock rules of spec/storage-pools-on-nfs.txt, "Cloud
provider NAS": their NFSv3 servers have no NLM locks, so v3 needs ``nolock`` (without
it the node would wait for a lock service that never answers); v4.0 has locks in the
protocol, so ``nolock`` is refused there.  ``noresvport`` is recommended by the
providers (a reconnect gets a fresh source port): its absence is a warning, not a
reason to refuse the pool.
"""

from __future__ import annotations

from typing import ClassVar

from kibotos_nfs import NfsDriver, NfsMount, Verdict

from kibotos.sdk import Register, hookimpl

__all__ = ["CloudNasDriver", "kibotos_register_storage_driver"]


class CloudNasDriver(NfsDriver):
    name: ClassVar[str] = "cloud-nas"
    CLOUD: ClassVar[bool] = True

    def lock_rules(self, mount: NfsMount, version: str, verdict: Verdict) -> None:
        nolock = mount.has("nolock")
        if version == "3" and not nolock:
            verdict.problems.append(
                "NFSv3 on a cloud provider's NAS needs nolock: its servers provide no NLM "
                "locks, and without nolock creating a Workspace waits for them")
        if version != "3" and nolock:
            verdict.problems.append(
                f"nolock is set on NFS {version}: the v4 protocol has its own locks, "
                "remove nolock")
        local_lock = mount.value("local_lock")
        if version != "3" and local_lock not in (None, "none"):
            verdict.problems.append(f"local_lock={local_lock} is set on NFS {version}: "
                                    "remove it")
        if not mount.has("noresvport"):
            verdict.warnings.append(
                "noresvport is recommended on a cloud provider's NAS (a reconnect then "
                "uses a new source port and avoids hangs on stale server state)")


@hookimpl
def kibotos_register_storage_driver(register: Register) -> None:
    register(CloudNasDriver)
