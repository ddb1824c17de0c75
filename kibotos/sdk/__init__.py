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

This module imports nothing heavy (no trio): the ``direct`` supervisor's launcher loads
it in a fresh interpreter at every unit start.
"""

from __future__ import annotations

from kibotos import atomicfile, procfs, vmm_launch
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
)
from kibotos.errors import (
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
from kibotos.hookspecs import Register, hookimpl
from kibotos.platform.cache import default_cache_root
from kibotos.sdk.options import BackendOptions, Kind, backend_options

__all__ = [
    "Aborted",
    "AlreadyExists",
    "Availability",
    "BackendOptions",
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
    "StorageDriver",
    "Supervisor",
    "Unauthenticated",
    "Unavailable",
    "UnitInfo",
    "UnitSpec",
    "VmmBackend",
    "atomicfile",
    "backend_options",
    "default_cache_root",
    "hookimpl",
    "procfs",
    "vmm_launch",
]
