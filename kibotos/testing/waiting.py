"""Wait for a condition in a test: poll it under a generous deadline, never a timed
assertion.

Machines that run tests are noisy, so a test never asserts how long something took; it
waits for the condition it needs and gives up only after a deadline that exists to bound
a hang.  When it gives up, the message says what was waited for and the last value the
probe returned, which is usually the clue::

    AssertionError: timed out after 60 s waiting for node-a eligible
    (last value seen: {'eligible': False, 'reasons': ['clock not measured']})

`wait_until` is the trio version: its deadline and its pauses are on trio's clock, so
under a `trio.testing.MockClock` with autojump a wait costs no real time.  Its probe may
be a plain function or an async one.  `wait_until_sync` is the same for blocking code
(the end-to-end tests that drive processes), on `time.monotonic`.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast, overload

import trio

T = TypeVar("T")

#: Long enough for a loaded two-core machine; short enough that a hang ends the test.
DEFAULT_TIMEOUT = 60.0
#: Between two probes of the trio version, which are cheap (in-process state, /proc).
DEFAULT_INTERVAL = 0.05
#: Between two probes of the blocking version, which usually start a process or make a
#: request to another one.
DEFAULT_SYNC_INTERVAL = 0.2
#: At most this much of the last value goes into the message.
_MAX_REPR = 2000


class WaitTimedOut(AssertionError):
    """A wait gave up.  An `AssertionError`, so pytest reports it as a test failure with
    the message, and ``pytest.raises(AssertionError)`` still catches it."""

    def __init__(self, what: str, timeout: float, last: object, probes: int) -> None:
        self.what = what
        self.timeout = timeout
        self.last = last
        self.probes = probes
        seen = repr(last) if probes else "none: the probe never returned"
        if len(seen) > _MAX_REPR:
            seen = seen[:_MAX_REPR] + "…"
        super().__init__(f"timed out after {timeout:g} s waiting for {what} "
                         f"(last value seen: {seen})")


# The overloads tell mypy what a probe's None means: "not yet", never returned.
@overload
async def wait_until(probe: Callable[[], Awaitable[T | None]], what: str, *,
                     timeout: float = ..., interval: float = ...) -> T: ...


@overload
async def wait_until(probe: Callable[[], T | None], what: str, *, timeout: float = ...,
                     interval: float = ...) -> T: ...


async def wait_until(probe: Callable[[], T | Awaitable[T | None] | None], what: str, *,
                     timeout: float = DEFAULT_TIMEOUT,
                     interval: float = DEFAULT_INTERVAL) -> T:
    """Call `probe` until it returns a true value, and return that value.

    `probe` may be a plain function or an async one (or return an awaitable); an
    exception from it ends the wait at once, as it is a bug, not a "not yet".  A probe
    still running at the deadline is cancelled.  Raises `WaitTimedOut` naming `what`
    and the last value seen after `timeout` seconds of trio's clock.
    """
    _check(what, timeout, interval)
    last: object = None
    probes = 0
    with trio.move_on_after(timeout):
        while True:
            value = probe()
            if inspect.isawaitable(value):
                value = await value
            last, probes = value, probes + 1
            if value:
                return cast(T, value)
            await trio.sleep(interval)
    raise WaitTimedOut(what, timeout, last, probes)


def wait_until_sync(probe: Callable[[], T | None], what: str, *,
                    timeout: float = DEFAULT_TIMEOUT,
                    interval: float = DEFAULT_SYNC_INTERVAL) -> T:
    """`wait_until` for blocking code: the same contract on `time.monotonic`, sleeping
    between probes.  The probe is always called at least once, and once more at the
    deadline, so a slow probe does not lose the last chance."""
    _check(what, timeout, interval)
    deadline = time.monotonic() + timeout
    last: object = None
    probes = 0
    while True:
        value = probe()
        last, probes = value, probes + 1
        if value:
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WaitTimedOut(what, timeout, last, probes)
        time.sleep(min(interval, remaining))


def _check(what: object, timeout: object, interval: object) -> None:
    if not isinstance(what, str) or not what:
        raise TypeError(f"what must be a non-empty description, not {what!r}")
    for name, value in (("timeout", timeout), ("interval", interval)):
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise TypeError(f"{name} must be a positive number of seconds, not {value!r}")
