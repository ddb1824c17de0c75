"""The hook specifications every kibotos plugin implements (pluggy, project "kibotos").

pluggy hooks are synchronous, so each hook only *registers* a backend class; the work
(async or not) lives on that class.  A plugin module looks like::

    from kibotos.hookspecs import hookimpl

    @hookimpl
    def kibotos_register_placement(register):
        register(BinpackPolicy)

and is announced to kibotos through an entry point in group ``kibotos``::

    [project.entry-points.kibotos]
    binpack = "kibotos_binpack"

The contracts of the registered classes are the protocols in `kibotos.backends`;
docs/plugins.md documents every hook (a test checks it does) and how to write a plugin.
Discovery and the registries are in `kibotos.plugins`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "kibotos"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[[type[Any]], None]


@hookspec
def kibotos_register_vmm(register: Register) -> None:
    """Register VMM backend classes (`kibotos.backends.VmmBackend`).

    Example::

        @hookimpl
        def kibotos_register_vmm(register):
            register(QemuVmm)
    """


@hookspec
def kibotos_register_storage_driver(register: Register) -> None:
    """Register storage-pool driver classes (`kibotos.backends.StorageDriver`).

    Example::

        @hookimpl
        def kibotos_register_storage_driver(register):
            register(LocalDriver)
    """


@hookspec
def kibotos_register_placement(register: Register) -> None:
    """Register placement policy classes (`kibotos.backends.PlacementPolicy`).

    Example::

        @hookimpl
        def kibotos_register_placement(register):
            register(SpreadPolicy)
    """


@hookspec
def kibotos_register_supervisor(register: Register) -> None:
    """Register process supervisor classes (`kibotos.backends.Supervisor`).

    Example::

        @hookimpl
        def kibotos_register_supervisor(register):
            register(DirectSupervisor)
    """
