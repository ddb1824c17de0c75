"""The egress process's control socket: JSON lines over a unix stream socket, with file
descriptors (SCM_RIGHTS) beside a line, in both directions (`kibotos.core.fd_control`).

``<socket dir>-egress/control-<generation>.sock`` (the directory 0700 and owned by
``kibotos-egress``, the socket 0600; one per generation, so the node reaches a draining
generation beside the newest) is where the node talks to its egress process, as
it talks to its data-plane process (`kibotos.dataplane.process.control`): each request is one
JSON object on one line, each answer one line, ``{"ok": true, "result": {…}}`` or
``{"ok": false, "error": {code, message}}``.  What is new here are descriptors, which
`kibotos.core.fd_control` carries (the data plane's listening-socket handover uses it too).
The process serves; the node calls (`call`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from kibotos.control_socket import check_socket_path
from kibotos.core import fd_control
from kibotos.core.fd_control import MAX_FDS, Channel, Handler, Message
from kibotos.core.logs import EventLogger

log = EventLogger("kibotos.egress")

CONTROL_SOCKET = "control-{generation}.sock"
SOCKET_DIR_SUFFIX = "-egress"
WHO = "egress process"
__all__ = ["MAX_FDS", "Channel", "Handler", "Message", "call", "control_path", "serve",
           "socket_dir_of"]


def socket_dir_of(node_socket_dir: Path) -> Path:
    """The egress process's directory, beside the node's socket directory."""
    node_socket_dir = Path(os.path.abspath(node_socket_dir))
    return node_socket_dir.with_name(node_socket_dir.name + SOCKET_DIR_SUFFIX)


def control_path(egress_dir: Path, generation: int) -> Path:
    return check_socket_path(egress_dir / CONTROL_SOCKET.format(generation=generation))


async def serve(path: Path, handle: Handler, *,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer requests on `path` until cancelled (`kibotos.core.fd_control.serve`)."""
    await fd_control.serve(path, handle, who=WHO, log=log, task_status=task_status)


async def call(path: Path, body: dict[str, Any], fds: Sequence[int] = (), *,
               timeout: float = 5.0) -> Message:
    """One request to the egress process at `path` (`kibotos.core.fd_control.call`)."""
    return await fd_control.call(path, body, fds, who=WHO, timeout=timeout)
