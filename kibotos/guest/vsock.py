"""Host-initiated vsock connections through Firecracker's unix socket.

Firecracker has no virtio-serial; its vsock device is backed by a unix socket on the
host (``uds_path``).  To reach a guest port the host connects to that socket and sends
``CONNECT <port>\\n``; Firecracker answers ``OK <host port>\\n`` once the guest accepted,
and from then on the connection is the byte stream to the guest.  When nothing listens
on that port in the guest yet (the agent is still starting) Firecracker closes the
connection instead, so the handshake is retried until the deadline
(docs/vsock.md in Firecracker's repository, "Host-Initiated Connections").

Used by the ``firecracker`` backend (its own agent connection) and by the data plane
(a target with a ``vsock_port``: the Instance's ``agent-dp.sock`` is then the VMM's
vsock socket, and every connection must start with the handshake).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import trio

from kibotos.core.errors import DeadlineExceeded, Internal, PermissionDenied

_OK = re.compile(rb"OK ([0-9]+)\n")
#: "OK 4294967295\n" is 14 bytes; anything longer is not Firecracker's answer.
_MAX_LINE = 32
_RETRY = 0.05


class HandshakeRefused(Exception):
    """Firecracker closed the connection: nothing accepted on that guest port (yet)."""


async def _read_line(stream: trio.SocketStream) -> bytes:
    """One line, a byte at a time: whatever the guest sends right after the answer
    belongs to the caller's stream and must not be read here."""
    line = b""
    while not line.endswith(b"\n"):
        byte = await stream.receive_some(1)
        if not byte:
            raise HandshakeRefused(f"connection closed after {line!r}")
        line += byte
        if len(line) > _MAX_LINE:
            raise Internal(f"vsock: unexpected answer from firecracker: {line!r}")
    return line


async def handshake(stream: trio.SocketStream, port: int) -> int:
    """Send ``CONNECT port``; the host-side port of the connection Firecracker made."""
    await stream.send_all(f"CONNECT {port}\n".encode())
    line = await _read_line(stream)
    m = _OK.fullmatch(line)
    if m is None:
        raise Internal(f"vsock: unexpected answer to CONNECT {port}: {line!r}")
    return int(m.group(1))


async def connect_vsock(uds: Path, port: int, deadline: float) -> trio.SocketStream:
    """A stream to guest vsock `port` through Firecracker's socket `uds`, retrying until
    `deadline` (trio time) while the socket is missing or the guest does not accept."""
    last: object = "never tried"
    while True:
        try:
            stream = await trio.open_unix_socket(os.fspath(uds))
        except PermissionError as exc:
            raise PermissionDenied(f"connecting to firecracker vsock socket {uds}: "
                                   f"{exc}") from exc
        except OSError as exc:
            last = exc
        else:
            try:
                with trio.move_on_at(deadline):
                    await handshake(stream, port)
                    return stream
                last = f"no answer to CONNECT {port}"
            except (HandshakeRefused, trio.BrokenResourceError) as exc:
                last = f"guest port {port} not accepting ({exc})"
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
            await trio.aclose_forcefully(stream)
        now = trio.current_time()
        if now >= deadline:
            raise DeadlineExceeded(f"the guest did not accept vsock port {port} through "
                                   f"{uds} before the deadline: {last}")
        await trio.sleep(min(_RETRY, deadline - now))
