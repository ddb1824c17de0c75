"""Assemble the Platform's initramfs: busybox, tini, the chosen modules and ``/init``.

Layout inside the archive::

    /init                          kibotos/platform/init.sh
    /bin/busybox, /bin/<applet>    busybox-static and one symlink per applet
    /bin/tini                      tini-static, copied into the new root's /run as PID 1
    /etc/kibotos/modules           the modules to insmod, one per line, in load order
    /etc/kibotos/modules.vsock     the vsock modules, loaded after them for kibotos.vsock=
    /etc/kibotos/modules.net       the virtio-net modules, loaded after them for kibotos.net=1
    /lib/modules/<release>/...     those modules (decompressed) and their modules.dep
    /dev/console, /proc, /sys, /mnt, /newroot

Why tini: the agent must not run as PID 1 itself (an orphaned grandchild would stay a
zombie, and PID 1 exiting panics the kernel mid-write), and the initramfs's busybox
is gone after ``switch_root``; tini-static is 700 kB, reaps, and forwards signals.
"""

from __future__ import annotations

import gzip
import importlib.resources
import subprocess
from pathlib import Path

import zstandard

from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.platform.cpio import CpioWriter
from kibotos.platform.modules import Module, modules_dep_lines

COMPRESSIONS = ("gzip", "zstd", "none")


def init_script() -> bytes:
    """The ``/init`` program, shipped beside this module."""
    return importlib.resources.files("kibotos.platform").joinpath("init.sh").read_bytes()


def busybox_applets(busybox: Path) -> list[str]:
    """The applet names this busybox binary provides (it runs on the build host)."""
    try:
        proc = subprocess.run([str(busybox), "--list"], capture_output=True, text=True,
                              check=False)
    except OSError as exc:
        raise FailedPrecondition(f"run {busybox} --list: {exc.strerror}") from None
    if proc.returncode != 0:
        raise FailedPrecondition(f"{busybox} --list exited with {proc.returncode}")
    names = sorted({n.strip() for n in proc.stdout.split() if n.strip()})
    for needed in ("sh", "mount", "insmod", "switch_root", "poweroff", "usleep", "cp", "ip"):
        if needed not in names:
            raise FailedPrecondition(f"{busybox} lacks the {needed!r} applet")
    return names


def compress(data: bytes, compression: str) -> bytes:
    if compression == "gzip":
        return gzip.compress(data, compresslevel=9, mtime=0)
    if compression == "zstd":
        return zstandard.ZstdCompressor(level=19).compress(data)
    if compression == "none":
        return data
    raise InvalidArgument(
        f"unknown initramfs compression {compression!r} (one of {', '.join(COMPRESSIONS)})"
    )


def build_initramfs(*, busybox: Path, tini: Path, release: str,
                    modules: list[tuple[Module, bytes]], compression: str,
                    vsock_modules: list[tuple[Module, bytes]] | None = None,
                    net_modules: list[tuple[Module, bytes]] | None = None) -> bytes:
    """The compressed initramfs for one kernel release.  `vsock_modules` (in load order,
    none of them in `modules`) are listed apart, in ``/etc/kibotos/modules.vsock``: the
    init loads them only for a guest reached over vsock; `net_modules` likewise in
    ``/etc/kibotos/modules.net``, for a guest with a network interface."""
    vsock, net = vsock_modules or [], net_modules or []
    extra = [*vsock, *net]
    modules = [*modules, *extra]
    w = CpioWriter()
    for d in ("bin", "dev", "etc", "etc/kibotos", "lib", "lib/modules", "mnt", "newroot",
              "proc", "sys", "run", "tmp"):
        w.directory(d)
    w.char_device("dev/console", 5, 1)
    w.file("bin/busybox", busybox.read_bytes(), 0o755)
    for applet in busybox_applets(busybox):
        if applet != "busybox":
            w.symlink(f"bin/{applet}", "busybox")
    w.file("bin/tini", tini.read_bytes(), 0o755)
    w.file("init", init_script(), 0o755)

    base = f"lib/modules/{release}"
    w.directory(base)
    made = {base}
    for mod, _ in modules:
        parts = mod.relpath.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = f"{base}/{'/'.join(parts[:i])}"
            if d not in made:
                w.directory(d)
                made.add(d)
    for mod, data in modules:
        w.file(f"{base}/{mod.relpath}", data)
    w.file(f"{base}/modules.dep", modules_dep_lines([m for m, _ in modules]).encode())
    always = modules[:len(modules) - len(extra)]
    w.file("etc/kibotos/modules",
           "".join(f"{release}/{m.relpath}\n" for m, _ in always).encode())
    w.file("etc/kibotos/modules.vsock",
           "".join(f"{release}/{m.relpath}\n" for m, _ in vsock).encode())
    w.file("etc/kibotos/modules.net",
           "".join(f"{release}/{m.relpath}\n" for m, _ in net).encode())
    return compress(w.render(), compression)
