"""Plugin discovery and the per-kind registries.

Built by `load_plugins()` and passed down; never a module-level manager (a global one
leaks registrations between tests and between roles, the bug datasette#2595 describes).

Order: built-in plugins first (the ``kibotos-builtin-*`` distributions, found through
their entry points like any other), then third-party entry points, then test-only
modules named in ``KIBOTOS_TEST_PLUGIN_MODULES`` (plugins that live in ``tests/`` and are
never installed).  Plugin names (the entry-point name, or the module name of a test
plugin) are unique, and so are backend names within a kind: a duplicate is an error that
names both modules, because silently preferring one would make behaviour depend on
install order.  Plugins named in the block list (config ``[plugins] disable`` or the
environment variable ``KIBOTOS_DISABLE_PLUGINS``, comma separated) are not imported at
all, so a broken plugin can be blocked too.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import inspect
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Generic, TypeVar

import pluggy

from kibotos import backends, hookspecs
from kibotos.core.errors import FailedPrecondition, InvalidArgument, KibotosError

ENTRY_POINT_GROUP = "kibotos"
DISABLE_ENV = "KIBOTOS_DISABLE_PLUGINS"
EXTRA_MODULES_ENV = "KIBOTOS_TEST_PLUGIN_MODULES"
BUILTIN_PREFIX = "kibotos-builtin-"

KINDS = ("vmm", "storage_driver", "placement", "supervisor")

#: The contract each kind's classes must meet (see `kibotos.backends`).
PROTOCOLS: dict[str, type[Any]] = {
    "vmm": backends.VmmBackend,
    "storage_driver": backends.StorageDriver,
    "placement": backends.PlacementPolicy,
    "supervisor": backends.Supervisor,
}

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


@dataclass(frozen=True)
class BlockedPlugin:
    """A plugin the block list kept out; ``source`` "not-installed" when nothing by
    that name was found (a typo, or a plugin this host does not have)."""

    plugin: str
    source: str  # "builtin", "entry-point", "test", or "not-installed"
    module: str | None


def _protocol_methods(proto: type[Any]) -> list[str]:
    """The required methods of a contract: its public callables without a default."""
    optional = backends.OPTIONAL_MEMBERS.get(proto, frozenset())
    return sorted(
        name for name, value in vars(proto).items()
        if callable(value) and not name.startswith("_") and name not in optional
    )


def _missing(cls: type[Any], proto: type[Any]) -> list[str]:
    """What `cls` lacks of `proto`: a required method it does not define (inheriting
    the Protocol's stub does not count), or an optional member it neither defines nor
    inherits from the Protocol."""
    stubs = vars(proto)
    missing = [m for m in _protocol_methods(proto)
               if not callable(getattr(cls, m, None)) or getattr(cls, m) is stubs[m]]
    missing += sorted(m for m in backends.OPTIONAL_MEMBERS.get(proto, frozenset())
                      if not hasattr(cls, m))
    return missing


class Registry(Generic[T]):
    """Backends of one kind, by unique name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[T]] = {}

    @property
    def label(self) -> str:
        return self.kind.replace("_", " ")

    def add(self, cls: type[T]) -> None:
        """Admit `cls` after checking it looks like the kind's contract."""
        if not inspect.isclass(cls):
            raise FailedPrecondition(f"{self.label} registration {cls!r} is not a class")
        where = f"{cls.__module__}.{cls.__qualname__}"
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise FailedPrecondition(f"{self.label} backend {where} has no name")
        proto = PROTOCOLS.get(self.kind)
        if proto is not None:
            missing = _missing(cls, proto)
            if missing:
                optional = backends.OPTIONAL_MEMBERS.get(proto, frozenset())
                hint = (f" (subclass kibotos.sdk.{proto.__name__} for the defaults of its "
                        "optional members)" if optional & set(missing) else "")
                raise FailedPrecondition(
                    f"{self.label} backend {name!r} ({where}) lacks {', '.join(missing)}"
                    + hint
                )
        if name in self._classes:
            raise FailedPrecondition(
                f"duplicate {self.label} backend {name!r}: "
                f"{self._classes[name].__module__} and {cls.__module__}"
            )
        self._classes[name] = cls

    def get(self, name: str) -> type[T]:
        try:
            return self._classes[name]
        except KeyError:
            known = ", ".join(sorted(self._classes)) or "none"
            raise InvalidArgument(
                f"unknown {self.label} {name!r} (available: {known})"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __len__(self) -> int:
        return len(self._classes)


@dataclass
class Registries:
    """Everything `load_plugins` found: one registry per kind, and where each came from."""

    manager: pluggy.PluginManager
    vmm: Registry[Any] = field(default_factory=lambda: Registry("vmm"))
    storage_driver: Registry[Any] = field(default_factory=lambda: Registry("storage_driver"))
    placement: Registry[Any] = field(default_factory=lambda: Registry("placement"))
    supervisor: Registry[Any] = field(default_factory=lambda: Registry("supervisor"))
    infos: list[PluginInfo] = field(default_factory=list)
    blocked: list[BlockedPlugin] = field(default_factory=list)

    def registry(self, kind: str) -> Registry[Any]:
        if kind not in KINDS:
            raise InvalidArgument(f"unknown plugin kind {kind!r} (kinds: {', '.join(KINDS)})")
        registry: Registry[Any] = getattr(self, kind)
        return registry

    def info(self, kind: str, name: str) -> PluginInfo:
        for info in self.infos:
            if info.kind == kind and info.name == name:
                return info
        self.registry(kind).get(name)  # raises the "unknown …" error listing the names
        raise AssertionError("unreachable: a registered backend has an info")


def blocked_names(disable: Iterable[str] = ()) -> list[str]:
    """The block list: config entries plus ``KIBOTOS_DISABLE_PLUGINS``, in that order."""
    names: list[str] = []
    for n in [*disable, *os.environ.get(DISABLE_ENV, "").split(",")]:
        n = n.strip()
        if n and n not in names:
            names.append(n)
    return names


@dataclass(frozen=True)
class _Candidate:
    """One plugin to load: where it comes from, loaded only if not blocked."""

    plugin: str
    source: str
    version: str
    module: str
    origin: str  # the distribution, or where a test module was named
    load: Callable[[], Any]

    @property
    def where(self) -> str:
        return f"{self.module} ({self.origin})"


def _entry_point_candidates() -> list[_Candidate]:
    builtin: list[_Candidate] = []
    third: list[_Candidate] = []
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        dist_name = dist.name if dist is not None else "unknown distribution"
        is_builtin = _normalize(dist_name).startswith(BUILTIN_PREFIX)
        version = dist.version if dist is not None else "unknown"
        cand = _Candidate(
            plugin=ep.name,
            source="builtin" if is_builtin else "entry-point",
            version=version,
            module=ep.value,
            origin=dist_name,
            load=_loader(ep),
        )
        (builtin if is_builtin else third).append(cand)
    return sorted(builtin, key=_order) + sorted(third, key=_order)


def _order(cand: _Candidate) -> tuple[str, str]:
    return (cand.plugin, cand.module)


def _loader(ep: md.EntryPoint) -> Callable[[], Any]:
    def load() -> Any:
        return ep.load()

    return load


def _module_loader(modname: str) -> Callable[[], ModuleType]:
    def load() -> ModuleType:
        return importlib.import_module(modname)

    return load


def _normalize(dist_name: str) -> str:
    return dist_name.lower().replace("_", "-").replace(".", "-")


def _test_candidates(modules: Sequence[str]) -> list[_Candidate]:
    return [
        _Candidate(plugin=m, source="test", version="test", module=m,
                   origin=EXTRA_MODULES_ENV, load=_module_loader(m))
        for m in modules
    ]


def _one_line(exc: BaseException) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _register_module(regs: Registries, module: Any, cand: _Candidate) -> None:
    """Register one plugin object and credit each class it registers to it."""
    try:
        regs.manager.register(module, name=cand.plugin)
        # Refuse hooks no spec knows (a typo like kibotos_register_vm) now, naming
        # the plugin, instead of never calling them.
        regs.manager.check_pending()
    except (pluggy.PluginValidationError, ValueError) as exc:
        raise FailedPrecondition(
            f"plugin {cand.plugin!r} from {cand.where} is invalid: {_one_line(exc)}"
        ) from exc
    for kind in KINDS:
        registry = regs.registry(kind)
        hook = getattr(regs.manager.hook, f"kibotos_register_{kind}")

        def register(
            cls: type[Any], _registry: Registry[Any] = registry, _kind: str = kind
        ) -> None:
            _registry.add(cls)
            regs.infos.append(
                PluginInfo(
                    kind=_kind,
                    name=cls.name,
                    plugin=cand.plugin,
                    version=cand.version,
                    source=cand.source,
                    module=cls.__module__,
                )
            )

        # Call this plugin's implementation alone, so each class is credited to it.
        for impl in hook.get_hookimpls():
            if impl.plugin is module:
                kwargs = {"register": register} if "register" in impl.argnames else {}
                try:
                    impl.function(**kwargs)
                except KibotosError:
                    raise
                except Exception as exc:
                    raise FailedPrecondition(
                        f"plugin {cand.plugin!r} from {cand.where}: {hook.name} failed: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc


def load_plugins(
    disable: Iterable[str] = (), *, test_modules: Sequence[str] | None = None
) -> Registries:
    """Discover every plugin and fill one registry per backend kind.

    `disable` is the config's ``[plugins] disable``; the environment adds to it.
    `test_modules` defaults to ``KIBOTOS_TEST_PLUGIN_MODULES`` (comma separated).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    regs = Registries(manager=pm)
    blocked = blocked_names(disable)
    if test_modules is None:
        test_modules = [
            m.strip() for m in os.environ.get(EXTRA_MODULES_ENV, "").split(",") if m.strip()
        ]
    seen: dict[str, _Candidate] = {}
    for cand in _entry_point_candidates() + _test_candidates(test_modules):
        if cand.plugin in seen:
            first = seen[cand.plugin]
            raise FailedPrecondition(
                f"duplicate plugin {cand.plugin!r}: {first.where} and {cand.where}"
            )
        seen[cand.plugin] = cand
        if cand.plugin in blocked:
            regs.blocked.append(BlockedPlugin(cand.plugin, cand.source, cand.module))
            continue
        try:
            module = cand.load()
        except Exception as exc:
            raise FailedPrecondition(
                f"plugin {cand.plugin!r} from {cand.where} failed to load: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        _register_module(regs, module, cand)
    for name in blocked:
        if name not in seen:
            regs.blocked.append(BlockedPlugin(name, "not-installed", None))
    return regs
