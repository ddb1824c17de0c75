"""kibotos-guest: the agent inside every Workspace VM.

Standard library only, Python >= 3.11, no import from the rest of kibotos: a Template
carries nothing but Debian's ``python3`` and this package, installed at
``/usr/lib/kibotos-guest/kibotos_guest/`` and byte-compiled at build time, next to the
launcher ``/usr/lib/kibotos-guest/agent.py`` that the guest init starts.  It serves the
guest protocol (docs/guest-protocol.md) over a virtio-serial port, a character device,
an inherited descriptor or (tests) a unix socket.

One module per job:

* `framing`: the 24-byte frame header, encoding and the resynchronising decoder
  (shared with the host client);
* `loop`, `tasks`: a small epoll event loop and its futures (asyncio cost half a second
  to import in a guest);
* `log`: one-line log records on stderr;
* `channel`, `streams`: sessions, and process streams under credit;
* `core`: shared state and request dispatch; `processes`: exec, signal, resize;
* `configure`; `netconf`: the network interface over rtnetlink (loaded by a configure
  that has a network); `stop`: stop_prepare, sync, thaw; `sysio`: files, mounts, libc
  calls;
* `transfers`, `fileops`, `fileinfo`, `bridge`, `tarstream`: the ``files`` requests
  (uploads and downloads in worker threads, directory trees as tar streams);
* `ports`: the ``ports`` requests (a TCP connection to the guest's loopback as a
  stream under credit, both ways, half-close kept);
* `transport`: finding the port, opening devices, the test socket; `cli`: main.

This file stays small: the host imports `framing` through it.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1
AGENT_VERSION = "0.6.0"
DEFAULT_PORT_NAME = "org.kibotos.agent.0"
CAPABILITIES = (
    "configure.dns", "configure.env", "configure.hostname", "configure.network",
    "configure.volumes", "exec", "exec.tty", "exec.user", "files", "files.watch",
    "flow_control", "freeze",
    "ping", "ports", "resize", "signal", "stop_prepare", "sync", "thaw", "user_names",
)
#: The requests of the ``files`` capability (`transfers`, loaded on the first one).
FILE_REQUESTS = (
    "file_stat", "file_list", "file_mkdir", "file_move", "file_remove", "file_read",
    "file_write", "tar_read", "tar_write", "transfer_commit", "transfer_cancel", "file_watch",
)


def main(argv: list[str] | None = None) -> int:
    """Run the agent (see `cli`); returns its exit status."""
    from .cli import main as cli_main

    return cli_main(argv)
