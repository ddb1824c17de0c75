"""Guest readiness over vsock: the agent's hello, while watching the guest console.

Firecracker writes the guest's serial console to its own stdout, which is the unit's
``vmm.log``.  A guest that will never say hello has usually printed why there
(``kibotos-init: FAILED: …``, a kernel panic), so the log is watched while waiting and
such a line ends the wait at once; a timeout carries the log's last lines.  The wait
itself is the shared `kibotos.sdk.guest.wait_hello`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from kibotos.sdk.guest import GuestInfo
from kibotos.sdk.guest import wait_hello as _wait_hello


async def wait_hello(connect: Callable[[], Awaitable[trio.abc.Stream]], log: Path,
                     deadline: float) -> GuestInfo:
    """Connect (`connect` retries until `deadline` itself), open a guest session, and
    return the hello; the session is closed afterwards.

    FailedPrecondition as soon as the console shows the guest cannot come up,
    DeadlineExceeded (with the vmm.log's tail) when it is not ready in time."""
    return await _wait_hello(connect, log, deadline, log_name="vmm.log")
