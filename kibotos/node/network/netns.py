"""Named network namespaces, and doing things inside one without moving the node.

Linux binds a network namespace to each *thread* (``setns(2)``), and a socket to the
namespace of the thread that created it.  So everything here that must happen in an
Instance's namespace runs on a short-lived thread that joins it, does that one thing
(create a netlink socket, a socket, open the tap, start ``nft``, write a sysctl) and
ends; the node's own threads never change namespace.  pyroute2's own netns support
forks a helper process per socket instead, which costs more than the rest of a setup.

This is the one module that translates pyroute2's errors (`map_netlink_errors`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from kibotos.core.errors import FailedPrecondition

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_SHARED = 1 << 20
MNT_DETACH = 2
NETLINK_ROUTE = 0

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str, path: object) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}", str(path))


def _join(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(fd, CLONE_NEWNET), "setns", path)
    finally:
        os.close(fd)


def _on_thread(prepare: Callable[[], None], fn: Callable[[], T]) -> T:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            prepare()
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, name="kibotos-netns", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def in_netns(path: Path | None, fn: Callable[[], T]) -> T:
    """`fn()` run in the namespace at `path` (None: the caller's own, on its thread)."""
    if path is None:
        return fn()
    return _on_thread(lambda: _join(path), fn)


def in_scratch_netns(fn: Callable[[], T]) -> T:
    """`fn()` run in a new, empty, unnamed namespace that vanishes when it returns
    (nothing to clean up after a crash)."""
    return _on_thread(lambda: _check(_libc.unshare(CLONE_NEWNET), "unshare", "netns"), fn)


# ---------------------------------------------------------------------------- named netns


def is_netns(path: Path) -> bool:
    """Whether `path` is a bound network namespace (not an empty file a crash left)."""
    try:
        return os.stat(path).st_dev == os.stat("/proc/self/ns/net").st_dev
    except FileNotFoundError:
        return False


def _share_dir(directory: Path) -> None:
    """Make `directory` a shared mount as ``ip netns add`` does, so the namespaces bound
    below it show in every mount namespace (VMM units run with ``PrivateMounts=no``)."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    if _libc.mount(b"", os.fsencode(directory), b"none", MS_SHARED | MS_REC, None) == 0:
        return
    _check(_libc.mount(os.fsencode(directory), os.fsencode(directory), b"none",
                       MS_BIND | MS_REC, None), "bind mount", directory)
    _check(_libc.mount(b"", os.fsencode(directory), b"none", MS_SHARED | MS_REC, None),
           "make shared", directory)


def create_netns(path: Path) -> bool:
    """Create and bind the namespace `path`; False when it already was (a retry).  A
    crash between the mount point and the bind leaves an empty file, bound here."""
    if is_netns(path):
        return False
    _share_dir(path.parent)
    with suppress(FileExistsError):
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0))

    def bind() -> None:
        source = f"/proc/self/task/{threading.get_native_id()}/ns/net".encode()
        _check(_libc.mount(source, os.fsencode(path), b"none", MS_BIND, None),
               "bind netns", path)

    in_scratch_netns(bind)
    return True


def remove_netns(path: Path) -> bool:
    """Unbind and remove the namespace `path`; False when there was nothing."""
    found = path.exists()
    if _libc.umount2(os.fsencode(path), MNT_DETACH) != 0:
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOENT):  # not mounted: an empty mount point
            raise OSError(code, f"umount: {os.strerror(code)}", str(path))
    with suppress(FileNotFoundError):
        path.unlink()
    return found


def netns_inode(path: Path) -> int:
    return os.stat(path).st_ino


# ---------------------------------------------------------------------------- inside one


def socket_in(path: Path | None, family: int, kind: int, proto: int = 0) -> socket.socket:
    """A socket of the namespace `path`, usable from any thread afterwards."""
    return in_netns(path, lambda: socket.socket(family, kind, proto))


@contextmanager
def netlink(path: Path | None) -> Iterator[Any]:
    """A pyroute2 ``IPRoute`` talking to the namespace `path`, closed afterwards; use
    it from the calling thread only (pyroute2 keeps a socket per thread)."""
    sock = socket_in(path, socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_ROUTE)
    ipr = IPRoute(fileno=sock.detach())
    try:
        yield ipr
    finally:
        ipr.close()


def write_sysctls(path: Path | None, values: dict[str, str]) -> None:
    """Write ``net.*`` sysctls of the namespace `path` (``/proc/sys/net`` shows the
    namespace of the thread that opens it)."""

    def write() -> None:
        for key, value in values.items():
            with open("/proc/sys/" + key.replace(".", "/"), "w") as f:
                f.write(value)

    in_netns(path, write)


@contextmanager
def map_netlink_errors(step: str) -> Iterator[None]:
    """pyroute2 and namespace errors as `FailedPrecondition` naming the step."""
    try:
        yield
    except NetlinkError as exc:
        raise FailedPrecondition(f"{step}: {os.strerror(exc.code)} (netlink error "
                                 f"{exc.code})") from None
    except OSError as exc:
        raise FailedPrecondition(f"{step}: {exc.strerror or exc}") from None
