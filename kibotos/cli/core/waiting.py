"""The wait loop every waiting ``kibo`` write shares (``workspace create|start|stop``,
``volume create|expand|move|delete``, ``workspace expand-layer|move-layer``).

One loop, so the rules hold alike everywhere: announce the wait once, ask ctrl to hold
each read (a long poll of at most `WAIT_SLICE`, within the request timeout and what is
left of the global ``--timeout``), wait out a restarting or slow ctrl, and let only the
global ``--timeout`` end the wait.  What "done" means, how one read is made and what the
timeout says stay with the caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kibotos.cli.core.options import Invocation
from kibotos.core.errors import DeadlineExceeded, Unavailable

#: The longest one wait request asks ctrl to hold (ctrl's limit is 60 s).
WAIT_SLICE = 20.0

Record = dict[str, Any]


def wait_until(inv: Invocation, record: Record, *, done: Callable[[Record], bool],
               waiting: Callable[[Record], str], read: Callable[[float], Record],
               timed_out: Callable[[Record], DeadlineExceeded],
               keep_read_error: bool = False) -> Record:
    """Read until `done(record)`.

    `read(hold)` makes one read, `hold` being how long ctrl may hold it (below 1 s the
    caller polls instead).  `waiting(record)` is the one "waiting for …" line;
    `timed_out(record)` the error once the global ``--timeout`` passed.  A read that
    fails (ctrl unreachable or slow) is retried; if the deadline passed meanwhile, that
    read's error is raised as is with `keep_read_error`, else `timed_out(record)`.
    """
    client = inv.client()
    announced = False
    while not done(record):
        if not announced:
            inv.out.message(waiting(record))
            announced = True
        remaining = inv.deadline.remaining()
        if remaining is not None and remaining <= 0:
            raise timed_out(record)
        hold = min(WAIT_SLICE, max(0.0, client.request_timeout - 5.0))
        if remaining is not None:
            hold = min(hold, max(0.0, remaining - 1.0))
        try:
            record = read(hold)
        except (Unavailable, DeadlineExceeded) as exc:
            if inv.deadline.expired():
                if keep_read_error:
                    raise
                raise timed_out(record) from None
            inv.out.message(f"{exc.message}; still waiting")
            time.sleep(min(2.0, inv.deadline.remaining() or 2.0))
    return record


def pause(inv: Invocation, most: float) -> None:
    """Sleep `most` seconds, or what is left of the global --timeout if that is less:
    a poll where ctrl cannot hold the request, but not a busy loop."""
    remaining = inv.deadline.remaining()
    time.sleep(max(0.0, min(most, remaining if remaining is not None else most)))
