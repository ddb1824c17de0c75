"""`kibotos.testing.clock.ThreadAwareClock`: it jumps like trio's autojump clock when
every task waits, and holds the jump while a worker thread runs, where trio's clock
fires the next timeout (trio issue #456)."""

from __future__ import annotations

import threading
from functools import partial

import pytest
import trio
import trio.testing

from kibotos.testing.clock import ThreadAwareClock


def run(clock: trio.abc.Clock, fn, *args):  # type: ignore[no-untyped-def]
    instruments = [clock] if isinstance(clock, trio.abc.Instrument) else []
    return trio.run(partial(fn, *args), clock=clock, instruments=instruments)


async def sleep_and_report(seconds: float) -> float:
    start = trio.current_time()
    await trio.sleep(seconds)
    return trio.current_time() - start


def test_a_long_sleep_passes_in_virtual_time() -> None:
    clock = ThreadAwareClock()
    assert run(clock, sleep_and_report, 3600.0) == pytest.approx(3600.0)
    assert clock.jumps >= 1


async def time_when_the_thread_returns(release: threading.Event) -> float:
    """Run a worker thread that returns only when the main thread lets it, while a
    sleeper keeps a deadline pending; the virtual time when the thread's result came."""

    def worker() -> None:
        release.wait(60)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep, 1)
        # The run loop has nothing to do until the thread is back: it idles.
        threading.Timer(0.3, release.set).start()
        await trio.to_thread.run_sync(worker)
        return trio.current_time()


def test_the_jump_is_held_while_a_thread_runs() -> None:
    clock = ThreadAwareClock()
    assert run(clock, time_when_the_thread_returns, threading.Event()) == 0.0
    assert clock.held_jumps >= 1
    assert clock.current_time() == pytest.approx(1.0)  # the sleeper's deadline, after


def test_trios_autojump_clock_jumps_meanwhile() -> None:
    """Why the class exists: under trio's autojump clock the sleeper's deadline passed
    while the thread ran (so would a session timeout)."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    assert trio.run(time_when_the_thread_returns, threading.Event(), clock=clock) >= 1.0


async def idle_waiter_first(clock: ThreadAwareClock) -> float:
    """`wait_all_tasks_blocked` wakes before the clock jumps past a pending sleep."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep, 10)
        await trio.testing.wait_all_tasks_blocked(cushion=0.01)
        woke_at = trio.current_time()
        nursery.cancel_scope.cancel()
    return woke_at


def test_wait_all_tasks_blocked_goes_before_a_jump() -> None:
    clock = ThreadAwareClock()
    assert run(clock, idle_waiter_first, clock) == 0.0


def test_a_hand_jump_moves_the_clock() -> None:
    clock = ThreadAwareClock()

    async def main() -> float:
        before = trio.current_time()
        clock.jump(5)
        return trio.current_time() - before

    assert run(clock, main) == pytest.approx(5.0)


async def test_the_fixture_is_this_clock(autojump_clock: ThreadAwareClock) -> None:
    """tests/conftest.py's ``autojump_clock`` reaches trio.run as clock and instrument."""
    assert isinstance(autojump_clock, ThreadAwareClock)
    assert await sleep_and_report(600.0) == pytest.approx(600.0)
    assert autojump_clock.jumps >= 1
