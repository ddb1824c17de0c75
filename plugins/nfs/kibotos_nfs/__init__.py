"""Built-in storage-pool driver ``nfs``: a pool on a self-hosted NFS server's export.

Registered through the plugin SDK (`kibotos.sdk`) only, like any third-party plugin.
"""

from __future__ import annotations

from kibotos.sdk import Register, hookimpl
from kibotos_nfs.driver import NfsDriver, Verdict, stated_version
from kibotos_nfs.mounts import NfsMount
from kibotos_nfs.writeback import MAX_BYTES, limit_dirty_pages

__all__ = ["MAX_BYTES", "NfsDriver", "NfsMount", "Verdict", "kibotos_register_storage_driver",
           "limit_dirty_pages", "stated_version"]


@hookimpl
def kibotos_register_storage_driver(register: Register) -> None:
    register(NfsDriver)
