"""Build a Platform directory (``vmlinux``, ``initramfs``, ``platform.json``), cached.

Inputs: the kernel package (``linux-image-amd64`` followed to the versioned package, or
a local .deb), ``busybox-static``, ``tini``, the init script, the module list and the
compression.  Their digests (the .deb SHA256s come from apt's index, so nothing is
downloaded to decide) form the cache key; an unchanged rebuild returns the existing
directory at once.  Used by ``packaging/platform/build.sh`` and the VM tests.

``platform.json``::

    {"format": 1, "kind": "kibotos-platform", "inputs_digest": "<hex>",
     "kernel": {"package", "version", "sha256", "release"},
     "busybox": {...}, "tini": {...}, "modules": ["virtio_ring", ...],
     "vsock_modules": ["vsock", ...],
     "initramfs_compression": "gzip",
     "files": {"vmlinux": {"sha256", "size"}, "initramfs": {"sha256", "size"}}}
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition, InvalidArgument, KibotosError
from kibotos.platform import debs
from kibotos.platform.cache import cached_build, default_cache_root, input_key
from kibotos.platform.initramfs import COMPRESSIONS, build_initramfs, init_script
from kibotos.platform.kernel import extract_vmlinux
from kibotos.platform.modules import (
    GUEST_MODULES,
    NET_MODULES,
    VSOCK_MODULES,
    Module,
    ModuleTree,
    read_module,
)

FORMAT = 1
MANIFEST = "platform.json"
#: Bump when the build itself changes in a way the listed inputs do not capture.
BUILDER_REVISION = 1
DEFAULT_COMPRESSION = "gzip"


def _digest(data: bytes) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def _only_child(path: Path, what: str) -> Path:
    children = sorted(path.iterdir()) if path.is_dir() else []
    if len(children) != 1:
        raise FailedPrecondition(f"{what}: expected one entry in {path}, found "
                                 f"{[c.name for c in children]}")
    return children[0]


def _read_modules(moddir: Path, order: list[Module]) -> list[tuple[Module, bytes]]:
    chosen = []
    for mod in order:
        data = read_module(moddir / mod.relpath)
        plain = mod.relpath.removesuffix(".xz").removesuffix(".zst")
        chosen.append((dataclasses.replace(mod, relpath=plain), data))
    return chosen


def _build(tmp: Path, refs: dict[str, debs.DebRef], modules: tuple[str, ...],
           vsock_modules: tuple[str, ...], compression: str, inputs: dict[str, Any],
           net_modules: tuple[str, ...] = NET_MODULES) -> None:
    work = Path(tempfile.mkdtemp(prefix="kibotos-platform-"))
    try:
        unpacked = {}
        for role, ref in refs.items():
            deb = debs.fetch(ref, work / "debs")
            unpacked[role] = debs.unpack(deb, work / role)
        moddir = _only_child(unpacked["kernel"] / "lib" / "modules", "kernel modules")
        release = moddir.name
        bzimage = unpacked["kernel"] / "boot" / f"vmlinuz-{release}"
        if not bzimage.is_file():
            raise FailedPrecondition(f"kernel package has no boot/vmlinuz-{release}")
        vmlinux = extract_vmlinux(bzimage.read_bytes(), bzimage.name)
        tree = ModuleTree(moddir)
        base = tree.load_order(list(modules))
        loaded = {m.name for m in base}
        extra = [m for m in tree.load_order([*modules, *vsock_modules])
                 if m.name not in loaded]
        net_extra = [m for m in tree.load_order([*modules, *net_modules])
                     if m.name not in loaded]
        chosen = _read_modules(moddir, base)
        vsock = _read_modules(moddir, extra)
        net = _read_modules(moddir, net_extra)
        busybox = unpacked["busybox"] / "bin" / "busybox"
        tini = unpacked["tini"] / "usr" / "bin" / "tini-static"
        for path in (busybox, tini):
            if not path.is_file():
                raise FailedPrecondition(f"{path.relative_to(work)} missing from its package")
        initramfs = build_initramfs(busybox=busybox, tini=tini, release=release,
                                    modules=chosen, compression=compression,
                                    vsock_modules=vsock, net_modules=net)
        (tmp / "vmlinux").write_bytes(vmlinux)
        (tmp / "initramfs").write_bytes(initramfs)
        manifest = {
            "format": FORMAT,
            "kind": "kibotos-platform",
            "inputs_digest": input_key(inputs),
            "kernel": {**refs["kernel"].describe(), "release": release},
            "busybox": refs["busybox"].describe(),
            "tini": refs["tini"].describe(),
            "modules": [m.name for m, _ in chosen],
            "vsock_modules": [m.name for m, _ in vsock],
            "net_modules": [m.name for m, _ in net],
            "initramfs_compression": compression,
            "files": {"vmlinux": _digest(vmlinux), "initramfs": _digest(initramfs)},
        }
        atomicfile.write_json(tmp / MANIFEST, manifest)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_platform(*, cache_root: Path | None = None, kernel_deb: Path | None = None,
                   busybox_deb: Path | None = None, tini_deb: Path | None = None,
                   kernel_package: str = "linux-image-amd64",
                   modules: tuple[str, ...] = GUEST_MODULES,
                   vsock_modules: tuple[str, ...] = VSOCK_MODULES,
                   net_modules: tuple[str, ...] = NET_MODULES,
                   compression: str = DEFAULT_COMPRESSION) -> Path:
    """The Platform directory for these inputs, building it on a cache miss.

    Each package comes from apt unless a local .deb is given for it (offline builds)."""
    if compression not in COMPRESSIONS:
        raise InvalidArgument(f"unknown initramfs compression {compression!r} "
                              f"(one of {', '.join(COMPRESSIONS)})")
    local = {"kernel": kernel_deb, "busybox": busybox_deb, "tini": tini_deb}
    names = {"kernel": kernel_package, "busybox": "busybox-static", "tini": "tini"}
    wanted = [names[role] for role, path in local.items() if path is None]
    resolved = debs.resolve(*wanted) if wanted else {}
    refs = {role: debs.local(path) if path is not None else resolved[names[role]]
            for role, path in local.items()}
    inputs = {
        "builder": BUILDER_REVISION,
        "debs": {role: ref.sha256 for role, ref in refs.items()},
        "init": hashlib.sha256(init_script()).hexdigest(),
        "modules": list(modules),
        "vsock_modules": list(vsock_modules),
        "net_modules": list(net_modules),
        "compression": compression,
    }
    root = (cache_root or default_cache_root()) / "platforms"
    return cached_build(root, input_key(inputs), MANIFEST,
                        lambda tmp: _build(tmp, refs, modules, vsock_modules, compression,
                                           inputs, net_modules))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="packaging/platform/build.sh",
        description="Build (or find in the cache) a kibotos Platform: vmlinux + initramfs.")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="cache root (default: $KIBOTOS_CACHE_DIR, /var/cache/kibotos "
                             "as root, ~/.cache/kibotos otherwise)")
    parser.add_argument("--kernel-deb", type=Path, default=None,
                        help="use this linux-image .deb instead of apt's linux-image-amd64")
    parser.add_argument("--busybox-deb", type=Path, default=None,
                        help="use this busybox-static .deb instead of apt's")
    parser.add_argument("--tini-deb", type=Path, default=None,
                        help="use this tini .deb instead of apt's")
    parser.add_argument("--compression", choices=COMPRESSIONS, default=DEFAULT_COMPRESSION)
    args = parser.parse_args(argv)
    try:
        path = build_platform(cache_root=args.cache_dir, kernel_deb=args.kernel_deb,
                              busybox_deb=args.busybox_deb, tini_deb=args.tini_deb,
                              compression=args.compression)
    except KibotosError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
