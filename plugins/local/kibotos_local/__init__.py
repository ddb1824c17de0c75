"""Built-in storage-pool driver ``local``: a pool on a file system of this host.

Registered through the public hook API only, like any third-party plugin.
"""

from __future__ import annotations

from kibotos.hookspecs import Register, hookimpl
from kibotos_local.driver import LocalDriver, Mount, find_mount, parse_mounts

__all__ = ["LocalDriver", "Mount", "find_mount", "kibotos_register_storage_driver",
           "parse_mounts"]


@hookimpl
def kibotos_register_storage_driver(register: Register) -> None:
    register(LocalDriver)
