"""Guest readiness over QEMU's agent socket: connect, then wait for the agent's hello.

The protocol is the guest agent's (docs/guest-protocol.md, `kibotos.sdk.guest`): its
client retries the first connect (QEMU creates the socket file before it listens), sends
the resync preamble and a ``hello_request``, and checks the guest's protocol version.
What only the backend knows is where the guest console is (``console.log``); the shared
`kibotos.sdk.guest.wait_hello` watches it while waiting, so a guest that printed why
it will never say hello (``kibotos-init: FAILED: …``, a kernel panic) ends the wait at
once, and a timeout carries the console's last lines.
"""

from __future__ import annotations

from pathlib import Path

from kibotos.sdk.guest import GuestInfo, connect_unix_with_retry
from kibotos.sdk.guest import wait_hello as _wait_hello


async def wait_hello(agent_socket: Path, console_log: Path, deadline: float) -> GuestInfo:
    """The guest's hello by `deadline` (trio time); the connection is closed afterwards.

    Raises FailedPrecondition as soon as the console shows the guest cannot come up,
    DeadlineExceeded (with the console's tail) when it is not ready in time, and
    `GuestProtocolUnsupported` for a guest outside the accepted protocol versions."""
    return await _wait_hello(lambda: connect_unix_with_retry(agent_socket, deadline),
                             console_log, deadline, log_name="guest console")
