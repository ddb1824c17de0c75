"""Plugin discovery and the per-kind registries.

Built by `load_plugins()` and passed down; never a module-level manager (a global one
leaks registrations between tests and between roles, the bug datasette#2595 describes).
Order: built-in plugins first (the ``kibotos-builtin-*`` distributions, found like any
other), then third-party entry points; names are unique per kind and a duplicate is an
error; plugins named in the block list (config ``[plugins] disable`` or the environment
variable ``KIBOTOS_DISABLE_PLUGINS``, comma separated) are not loaded at all.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import pluggy

from kibotos import hookspecs
from kibotos.errors import FailedPrecondition, InvalidArgument

ENTRY_POINT_GROUP = "kibotos"
DISABLE_ENV = "KIBOTOS_DISABLE_PLUGINS"
EXTRA_MODULES_ENV = "KIBOTOS_TEST_PLUGIN_MODULES"

KINDS = ("vmm", "storage_driver", "placement", "supervisor")

T = TypeVar("T")


@dataclass(frozen=True)
class PluginInfo:
    """Where one registered backend came from."""

    kind: str
    name: str
    plugin: str
    version: str
    source: str  # "builtin", "entry-point", or "test"
    module: str


class Registry(Generic[T]):
    """Backends of one kind, by unique name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[T]] = {}

    def add(self, cls: type[T]) -> None:
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise FailedPrecondition(f"{self.kind} backend {cls!r} has no name")
        if name in self._classes:
            raise FailedPrecondition(
                f"duplicate {self.kind} backend {name!r}: "
                f"{self._classes[name].__module__} and {cls.__module__}"
            )
        self._classes[name] = cls

    def get(self, name: str) -> type[T]:
        try:
            return self._classes[name]
        except KeyError:
            known = ", ".join(sorted(self._classes)) or "none"
            raise InvalidArgument(
                f"unknown {self.kind.replace('_', ' ')} {name!r} (available: {known})"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        return name in self._classes


@dataclass
class Registries:
    manager: pluggy.PluginManager
    vmm: Registry[Any] = field(default_factory=lambda: Registry("vmm"))
    storage_driver: Registry[Any] = field(default_factory=lambda: Registry("storage_driver"))
    placement: Registry[Any] = field(default_factory=lambda: Registry("placement"))
    supervisor: Registry[Any] = field(default_factory=lambda: Registry("supervisor"))
    infos: list[PluginInfo] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)


def _blocked_names(disable: Iterable[str]) -> set[str]:
    names = {n.strip() for n in disable if n.strip()}
    names |= {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    return names


def _register_module(
    regs: Registries, module: Any, plugin: str, version: str, source: str
) -> None:
    regs.manager.register(module, name=plugin)
    for kind in KINDS:
        registry: Registry[Any] = getattr(regs, kind)
        hook = getattr(regs.manager.hook, f"kibotos_register_{kind}")

        def register(cls: type[Any], _registry: Registry[Any] = registry, _kind: str = kind) -> None:
            _registry.add(cls)
            regs.infos.append(
                PluginInfo(
                    kind=_kind,
                    name=cls.name,
                    plugin=plugin,
                    version=version,
                    source=source,
                    module=cls.__module__,
                )
            )

        # Call this plugin's implementation alone, so each class is credited to it.
        for impl in hook.get_hookimpls():
            if impl.plugin is module:
                impl.function(register=register)
    regs.manager.check_pending()


def load_plugins(disable: Iterable[str] = ()) -> Registries:
    """Discover every plugin and fill one registry per backend kind."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    regs = Registries(manager=pm)
    blocked = _blocked_names(disable)
    entry_points = sorted(
        md.entry_points(group=ENTRY_POINT_GROUP),
        key=lambda ep: (not _is_builtin(ep), ep.name),
    )
    for ep in entry_points:
        if ep.name in blocked:
            regs.blocked.append(ep.name)
            continue
        dist = ep.dist
        version = dist.version if dist is not None else "unknown"
        source = "builtin" if _is_builtin(ep) else "entry-point"
        _register_module(regs, ep.load(), ep.name, version, source)
    for modname in filter(None, os.environ.get(EXTRA_MODULES_ENV, "").split(",")):
        # Test-only plugins from tests/ (see docs/dev.md); they are not installed.
        if modname in blocked:
            regs.blocked.append(modname)
            continue
        _register_module(regs, importlib.import_module(modname), modname, "test", "test")
    return regs


def _is_builtin(ep: md.EntryPoint) -> bool:
    dist = ep.dist
    return dist is not None and dist.name.lower().replace("_", "-").startswith("kibotos-builtin-")
