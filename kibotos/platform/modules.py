"""Pick the kernel modules the guest init loads, with their dependencies, in load order.

The order TESTBED measured (``virtio_ring virtio virtio_mmio virtio_console virtio_blk
crc32c_generic ext4``, then ``overlay`` for the root) is kept, and each module's
dependencies are put before it.  Dependencies come from ``modules.dep`` when the tree
has one (an installed kernel); Debian's package has none (depmod writes it at install
time and this machine has no kmod), so then they come from each module's ``.modinfo``
``depends=`` field, which is where depmod's answer comes from in the first place.
Compressed modules (``.ko.xz``, ``.ko.zst``) are decompressed, because busybox
``insmod`` hands the bytes to the kernel as they are.
"""

from __future__ import annotations

import lzma
from dataclasses import dataclass
from pathlib import Path

import zstandard

from kibotos.core.errors import InvalidArgument
from kibotos.platform.elf import modinfo

#: What the Platform init loads, in this order (TESTBED), plus ``overlay`` for the root.
GUEST_MODULES = ("virtio_ring", "virtio", "virtio_mmio", "virtio_console", "virtio_blk",
                 "crc32c_generic", "ext4", "overlay")

#: Loaded only when the kernel command line has ``kibotos.vsock=PORT`` (Firecracker: the
#: agent is reached over vsock, there is no virtio-serial).  On a QEMU boot they would
#: cost a TCG guest time for a device it does not have.
VSOCK_MODULES = ("vsock", "vmw_vsock_virtio_transport_common", "vmw_vsock_virtio_transport")

#: Loaded only when the kernel command line has ``kibotos.net=1`` (a launch with a
#: network: the guest has a virtio-net device); its dependencies (``net_failover``,
#: ``failover``) come with it.
NET_MODULES = ("virtio_net",)

_SUFFIXES = (".ko", ".ko.xz", ".ko.zst")


def module_name(path: str) -> str:
    """``kernel/fs/ext4/ext4.ko.xz`` → ``ext4``; dashes and underscores are the same."""
    base = path.rsplit("/", 1)[-1]
    for suffix in _SUFFIXES:
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base.replace("-", "_")


def read_module(path: Path) -> bytes:
    """The plain ELF bytes of a module file, decompressing if its name says so."""
    data = path.read_bytes()
    if path.name.endswith(".ko.xz"):
        return lzma.decompress(data)
    if path.name.endswith(".ko.zst"):
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return data


@dataclass(frozen=True)
class Module:
    name: str
    relpath: str  # under lib/modules/<version>/, as in modules.dep
    depends: tuple[str, ...]


class ModuleTree:
    """The modules of one kernel version, under ``<root>/lib/modules/<version>``."""

    def __init__(self, moddir: Path) -> None:
        if not moddir.is_dir():
            raise InvalidArgument(f"kernel module directory {moddir} does not exist")
        self.moddir = moddir
        self._dep = self._read_modules_dep()
        self._paths: dict[str, str] | None = None

    def _read_modules_dep(self) -> dict[str, tuple[str, list[str]]] | None:
        dep_file = self.moddir / "modules.dep"
        if not dep_file.is_file():
            return None
        table: dict[str, tuple[str, list[str]]] = {}
        for line in dep_file.read_text().splitlines():
            if ":" not in line:
                continue
            path, _, rest = line.partition(":")
            table[module_name(path)] = (path, [module_name(p) for p in rest.split()])
        return table

    def _path_of(self, name: str) -> str:
        if self._paths is None:
            self._paths = {}
            for f in sorted(self.moddir.rglob("*.ko*")):
                if f.name.endswith(_SUFFIXES):
                    self._paths.setdefault(module_name(f.name),
                                           f.relative_to(self.moddir).as_posix())
        try:
            return self._paths[name]
        except KeyError:
            raise InvalidArgument(
                f"kernel module {name!r} not found under {self.moddir} "
                "(built into the kernel or missing from this kernel package?)"
            ) from None

    def module(self, name: str) -> Module:
        name = name.replace("-", "_")
        if self._dep is not None:
            if name not in self._dep:
                raise InvalidArgument(f"kernel module {name!r} is not in {self.moddir}/modules.dep")
            path, deps = self._dep[name]
            return Module(name, path, tuple(deps))
        path = self._path_of(name)
        info = modinfo(read_module(self.moddir / path), f"module {path}")
        depends = [d for v in info.get("depends", []) for d in v.split(",") if d]
        return Module(name, path, tuple(module_name(d) for d in depends))

    def load_order(self, names: tuple[str, ...] | list[str]) -> list[Module]:
        """`names` with every dependency before its user, each module once.

        The requested order is kept where dependencies allow; a dependency cycle (which
        depmod would also refuse) is an error naming the modules in it."""
        order: list[Module] = []
        done: set[str] = set()

        def visit(name: str, stack: tuple[str, ...]) -> None:
            name = name.replace("-", "_")
            if name in done:
                return
            if name in stack:
                raise InvalidArgument(f"kernel module dependency cycle: {' -> '.join(stack)}")
            mod = self.module(name)
            for dep in mod.depends:
                visit(dep, (*stack, name))
            done.add(name)
            order.append(mod)

        for name in names:
            visit(name, ())
        return order


def modules_dep_lines(modules: list[Module]) -> str:
    """A ``modules.dep`` for the chosen modules (what depmod would write for them)."""
    by_name = {m.name: m for m in modules}
    lines = []
    for m in modules:
        closure: list[str] = []

        def walk(n: str, _closure: list[str] = closure) -> None:
            for d in by_name[n].depends:
                if by_name[d].relpath not in _closure:
                    _closure.append(by_name[d].relpath)
                    walk(d)

        walk(m.name)
        lines.append(f"{m.relpath}: {' '.join(closure)}".rstrip())
    return "\n".join(lines) + "\n"
