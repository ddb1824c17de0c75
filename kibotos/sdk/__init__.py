"""The plugin SDK: everything a kibotos plugin may import, exported from one place.

A plugin (docs/plugins.md) imports kibotos only through `kibotos.sdk` and its
submodules.  The built-in plugins do the same (tests/unit/test_architecture.py checks
it), so a third-party plugin can do all they do, and the core may change whatever the
SDK does not name.

==========================  ===========================================================
``kibotos.sdk``             the hooks (`hookimpl`, `Register`); the four contracts and
                            the data they exchange; the errors; `backend_options` (a
                            backend's option checks, one message format);
                            `default_cache_root`; and three modules:
``kibotos.sdk.atomicfile``  crash-safe writes: temporary file, fsync, rename
``kibotos.sdk.procfs``      ``/proc``: process status, boot facts, the mount tables
``kibotos.sdk.vmm_launch``  the launch description's checks every VMM backend shares
``kibotos.sdk.guest``       reaching the guest agent (socket, vsock, the hello wait);
                            imports trio, so it is a module of its own
==========================  ===========================================================

Each name is imported on first use (PEP 562 ``__getattr__``): the ``direct``
supervisor's launcher, which runs in a fresh interpreter at every unit start, takes
`atomicfile` and `procfs` from here and pays for nothing else (eagerly importing the
rest cost it about 10 ms per start).  `_MODULES` and `_NAMES` say where each name lives;
the ``TYPE_CHECKING`` imports say the same to mypy, which thus checks every name a
plugin imports; tests/plugins/test_sdk.py checks that they and `__all__` agree.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kibotos import vmm_launch
    from kibotos.backends import (
        Availability,
        HostPaths,
        KeyedPlacementPolicy,
        NodeCapacity,
        PlacementPolicy,
        PlacementRequest,
        PoolSpec,
        StorageDriver,
        Supervisor,
        UnitInfo,
        UnitSpec,
        VmmBackend,
        check_unit_name,
    )
    from kibotos.core import atomicfile, procfs
    from kibotos.core.errors import (
        Aborted,
        AlreadyExists,
        DeadlineExceeded,
        FailedPrecondition,
        Internal,
        InvalidArgument,
        KibotosError,
        NotFound,
        PermissionDenied,
        ResourceExhausted,
        Unauthenticated,
        Unavailable,
    )
    from kibotos.core.path_tables import Below
    from kibotos.hookspecs import Register, hookimpl
    from kibotos.platform.cache import default_cache_root
    from kibotos.sdk.options import BackendOptions, Kind, backend_options
    from kibotos.sdk.placement import SortedPlacementPolicy

#: The modules the SDK exports, and where every other name is defined.
_MODULES: dict[str, str] = {
    "atomicfile": "kibotos.core.atomicfile",
    "procfs": "kibotos.core.procfs",
    "vmm_launch": "kibotos.vmm_launch",
}
_NAMES: dict[str, str] = {
    "Availability": "kibotos.backends",
    "HostPaths": "kibotos.backends",
    "KeyedPlacementPolicy": "kibotos.backends",
    "NodeCapacity": "kibotos.backends",
    "PlacementPolicy": "kibotos.backends",
    "PlacementRequest": "kibotos.backends",
    "PoolSpec": "kibotos.backends",
    "StorageDriver": "kibotos.backends",
    "Supervisor": "kibotos.backends",
    "UnitInfo": "kibotos.backends",
    "UnitSpec": "kibotos.backends",
    "VmmBackend": "kibotos.backends",
    "check_unit_name": "kibotos.backends",
    "Aborted": "kibotos.core.errors",
    "AlreadyExists": "kibotos.core.errors",
    "DeadlineExceeded": "kibotos.core.errors",
    "FailedPrecondition": "kibotos.core.errors",
    "Internal": "kibotos.core.errors",
    "InvalidArgument": "kibotos.core.errors",
    "KibotosError": "kibotos.core.errors",
    "NotFound": "kibotos.core.errors",
    "PermissionDenied": "kibotos.core.errors",
    "ResourceExhausted": "kibotos.core.errors",
    "Unauthenticated": "kibotos.core.errors",
    "Unavailable": "kibotos.core.errors",
    "Register": "kibotos.hookspecs",
    "hookimpl": "kibotos.hookspecs",
    "Below": "kibotos.core.path_tables",
    "default_cache_root": "kibotos.platform.cache",
    "BackendOptions": "kibotos.sdk.options",
    "Kind": "kibotos.sdk.options",
    "backend_options": "kibotos.sdk.options",
    "SortedPlacementPolicy": "kibotos.sdk.placement",
}

if not TYPE_CHECKING:  # mypy sees the imports above, not a catch-all __getattr__

    def __getattr__(name: str) -> Any:
        """Import `name` from where it lives, once (PEP 562)."""
        if name in _MODULES:
            value = importlib.import_module(_MODULES[name])
        elif name in _NAMES:
            value = getattr(importlib.import_module(_NAMES[name]), name)
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value
        return value


__all__ = [
    "Aborted",
    "AlreadyExists",
    "Availability",
    "BackendOptions",
    "Below",
    "DeadlineExceeded",
    "FailedPrecondition",
    "HostPaths",
    "Internal",
    "InvalidArgument",
    "KeyedPlacementPolicy",
    "KibotosError",
    "Kind",
    "NodeCapacity",
    "NotFound",
    "PermissionDenied",
    "PlacementPolicy",
    "PlacementRequest",
    "PoolSpec",
    "Register",
    "ResourceExhausted",
    "SortedPlacementPolicy",
    "StorageDriver",
    "Supervisor",
    "Unauthenticated",
    "Unavailable",
    "UnitInfo",
    "UnitSpec",
    "VmmBackend",
    "atomicfile",
    "backend_options",
    "check_unit_name",
    "default_cache_root",
    "hookimpl",
    "procfs",
    "vmm_launch",
]
