"""The host end of the guest agent channel: QEMU's unix socket for the virtio-serial port.

TESTBED: the socket file exists before QEMU listens on it, so the first connect is
retried (ECONNREFUSED, and ENOENT before QEMU created it) until a deadline.  QEMU's
socket chardev takes one client at a time; whoever holds the connection owns the
channel until it closes it.
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import trio

from kibotos.errors import DeadlineExceeded, Unavailable

_RETRY_ERRNOS = {errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN}
RETRY_INTERVAL = 0.02


async def connect_unix(path: Path, *, timeout: float) -> trio.SocketStream:
    """A stream connected to `path`, retrying while nothing listens yet.

    Raises DeadlineExceeded after `timeout` seconds, Unavailable for errors that
    retrying cannot fix (permission denied, a path that is not a socket)."""
    last = "nothing listened"
    with trio.move_on_after(timeout):
        while True:
            sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                await sock.connect(str(path))
            except OSError as exc:
                sock.close()
                if exc.errno not in _RETRY_ERRNOS:
                    raise Unavailable(f"connect to guest agent socket {path}: "
                                      f"{exc.strerror}") from None
                last = exc.strerror or str(exc)
                await trio.sleep(RETRY_INTERVAL)
                continue
            return trio.SocketStream(sock)
    raise DeadlineExceeded(f"guest agent socket {path}: no listener within {timeout:g} s "
                           f"({last})")
