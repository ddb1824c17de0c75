"""An autojump clock for trio tests that does not jump while a worker thread runs.

trio's autojump clock (``MockClock(autojump_threshold=0)``, pytest-trio's
``autojump_clock``) jumps to the next deadline as soon as every task is blocked.  A task
waiting for `trio.to_thread.run_sync` counts as blocked (trio issue #456), so while
ctrl's store runs a SQLite transaction in its worker thread the clock jumps to the next
timeout and fires it: a session timeout, or the test's own deadline, passes in the
middle of a 5 ms commit.

`ThreadAwareClock` is a virtual clock (it moves only by jumps) and a trio `Instrument`
that does the jumping: just before the run loop would wait for I/O with nothing to run,
it jumps to the next deadline, unless a thread of trio's default limiter (the one
`trio.to_thread.run_sync` uses unless given another) is out or a callback from one is
queued.  Then it does nothing, and the loop sleeps until the thread is back.  pytest-trio
hands a fixture value that is a Clock to ``trio.run`` as its clock and one that is an
Instrument as an instrument, so a test takes it like any clock fixture (tests/conftest.py
``autojump_clock``).  It uses only trio's public API.

Still invisible to it, as to trio's: a subprocess, a real socket, a thread of another
limiter.  A test that waits for one of those stays on real time.
"""

from __future__ import annotations

import math

import trio
import trio.testing

#: What `deadline_to_sleep_time` answers for a deadline in the future: "sleep until
#: woken" (the clock does not move by itself).  trio clamps it to its own maximum.
_UNTIL_WOKEN = 86400.0
#: An I/O wait at least this long means nothing is runnable and no deadline is due; a
#: shorter non-zero one is ``wait_all_tasks_blocked``'s cushion, which goes first.
_IDLE_WAIT = 3600.0


def _wake() -> None:
    """Queued after a jump so the I/O wait ends at once and the deadline is expired."""


class ThreadAwareClock(trio.abc.Clock, trio.abc.Instrument):
    """A virtual clock that autojumps when every task is blocked and no worker thread
    of the default limiter runs (see the module docstring)."""

    def __init__(self) -> None:
        self._clock = trio.testing.MockClock()
        #: Jumps made, and idle moments passed without one because a thread ran.
        self.jumps = 0
        self.held_jumps = 0

    # ---------------------------------------------------------------- trio.abc.Clock

    def start_clock(self) -> None:
        self._clock.start_clock()

    def current_time(self) -> float:
        return self._clock.current_time()

    def deadline_to_sleep_time(self, deadline: float) -> float:
        return 0.0 if deadline <= self._clock.current_time() else _UNTIL_WOKEN

    def jump(self, seconds: float) -> None:
        """Move the clock forward by hand, as `trio.testing.MockClock.jump` does."""
        self._clock.jump(seconds)

    # ---------------------------------------------------------------- trio.abc.Instrument

    def before_io_wait(self, timeout: float) -> None:
        if timeout < _IDLE_WAIT:
            return  # something runs, a deadline is due, or an idle waiter goes first
        stats = trio.lowlevel.current_statistics()
        limiter = trio.to_thread.current_default_thread_limiter()
        if limiter.borrowed_tokens or stats.run_sync_soon_queue_size:
            self.held_jumps += 1
            return  # the thread's result wakes the loop; decide again then
        seconds = stats.seconds_to_next_deadline
        if 0 < seconds < math.inf:
            self._clock.jump(seconds)
            self.jumps += 1
            trio.lowlevel.current_trio_token().run_sync_soon(_wake)
