"""Built-in storage-pool driver ``local``: a pool on a file system of this host.

Registered through the plugin SDK (`kibotos.sdk`) only, like any third-party plugin.
"""

from __future__ import annotations

from kibotos.sdk import Register, hookimpl
from kibotos_local.driver import LocalDriver

__all__ = ["LocalDriver", "kibotos_register_storage_driver"]


@hookimpl
def kibotos_register_storage_driver(register: Register) -> None:
    register(LocalDriver)
