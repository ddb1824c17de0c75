"""Where the channels come from: a virtio-serial port found by name, any character
device, or (tests) a listening unix socket.

A virtio port appears shortly after its module loads and can be opened only once, so
the agent waits for it and keeps one read-write descriptor for its lifetime
(docs/guest-protocol.md, "Transport").
"""

from __future__ import annotations

import errno
import os
import stat
import time

from ..log import log
from .channel import Channel
from .loop import get_loop
from .tasks import sleep

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from collections.abc import Callable

    from ..core import Agent


def find_port_device(name: str, sysfs: str = "/sys/class/virtio-ports", dev: str = "/dev") -> (
    str | None
):
    """The /dev node of the virtio-serial port called `name`, if it has appeared."""
    try:
        entries = sorted(os.listdir(sysfs))
    except FileNotFoundError:
        return None
    for entry in entries:
        try:
            with open(os.path.join(sysfs, entry, "name")) as f:
                found = f.read().strip()
        except FileNotFoundError:
            continue
        if found == name:
            return os.path.join(dev, entry)
    return None


def open_device(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    if os.isatty(fd):
        import tty  # a tty (tests, a serial console) must pass bytes through untouched

        tty.setraw(fd)
    return fd


async def wait_for_device(describe: str, find: Callable[[], str | None]) -> tuple[str, int]:
    """Open the channel device once it exists: the port appears after the module loads."""
    started = time.monotonic()
    last_log = started
    while True:
        path = find()
        if path is not None:
            try:
                return path, open_device(path)
            except OSError as e:
                if e.errno != errno.ENOENT and time.monotonic() - last_log >= 10:
                    log.warning("opening %s: %s; retrying", path, e)
                    last_log = time.monotonic()
        if time.monotonic() - last_log >= 10:
            log.warning("still waiting for %s after %.0fs", describe, time.monotonic() - started)
            last_log = time.monotonic()
        await sleep(0.1)


def listen(agent: Agent, path: str) -> socket.socket:
    """Listen on a unix socket: one channel (one session) per connection."""
    import socket

    if os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    return _serve(agent, sock)


def listen_vsock(agent: Agent, port: int) -> socket.socket:
    """Listen on an AF_VSOCK port of this guest (any CID): one channel per connection,
    as with a unix socket.  Firecracker's host side reaches it by ``CONNECT <port>``
    on its vsock unix socket; every connection is an independent session."""
    import socket

    if not 0 < port < 2**32 - 1:
        raise ValueError(f"vsock port {port} is out of range")
    sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    sock.bind((socket.VMADDR_CID_ANY, port))
    return _serve(agent, sock)


def _serve(agent: Agent, sock: socket.socket) -> socket.socket:
    sock.listen(16)
    sock.setblocking(False)
    counter = 0

    def accept() -> None:
        nonlocal counter
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return
        counter += 1
        agent.add_channel(Channel(agent, f"connection {counter}", conn.detach(),
                                  reconnectable=False))

    get_loop().add_reader(sock.fileno(), accept)
    return sock
