"""`kibotos.testing.waiting`: the one wait of the test suite, trio and blocking."""

from __future__ import annotations

import itertools
import re

import pytest
import trio

from kibotos.testing.clock import ThreadAwareClock
from kibotos.testing.waiting import WaitTimedOut, wait_until, wait_until_sync


def counter_reaching(n: int):  # type: ignore[no-untyped-def]
    count = itertools.count(1)
    return lambda: (value := next(count)) >= n and value


async def test_returns_the_first_true_value(autojump_clock: ThreadAwareClock) -> None:
    assert await wait_until(counter_reaching(3), "the third probe") == 3


async def test_an_async_probe_is_awaited(autojump_clock: ThreadAwareClock) -> None:
    seen: list[int] = []

    async def probe() -> list[int] | None:
        await trio.sleep(1)
        seen.append(len(seen))
        return seen if len(seen) == 2 else None

    assert await wait_until(probe, "two probes") == [0, 1]


async def test_the_timeout_names_what_and_the_last_value(
        autojump_clock: ThreadAwareClock) -> None:
    probes = itertools.count()

    def probe() -> list[str] | None:
        return None if next(probes) < 3 else []  # the last value differs from the first

    with pytest.raises(WaitTimedOut) as info:
        await wait_until(probe, "node-a eligible", timeout=2, interval=0.5)
    message = str(info.value)
    assert message.startswith("timed out after 2 s waiting for node-a eligible")
    assert message.endswith("(last value seen: [])")
    assert info.value.probes >= 4
    assert isinstance(info.value, AssertionError)


async def test_a_probe_still_running_at_the_deadline_is_cancelled(
        autojump_clock: ThreadAwareClock) -> None:
    async def never() -> bool:
        await trio.sleep_forever()
        return True  # pragma: no cover

    with pytest.raises(WaitTimedOut, match=r"never returned"):
        await wait_until(never, "a probe that hangs", timeout=5)


async def test_a_probe_that_raises_ends_the_wait(autojump_clock: ThreadAwareClock) -> None:
    def broken() -> bool:
        raise KeyError("state")

    with pytest.raises(KeyError):
        await wait_until(broken, "a broken probe")


def test_a_huge_last_value_is_cut() -> None:
    error = WaitTimedOut("x", 1.0, "y" * 10_000, 1)
    assert len(str(error)) < 2200
    assert str(error).endswith("…)")


def test_sync_returns_the_first_true_value() -> None:
    assert wait_until_sync(counter_reaching(3), "the third probe", interval=0.001) == 3


def test_sync_timeout_probes_once_more_at_the_deadline() -> None:
    calls: list[int] = []

    def probe() -> list[int]:
        calls.append(1)
        return []

    with pytest.raises(WaitTimedOut, match=re.escape("waiting for nothing (last value "
                                                     "seen: [])")):
        wait_until_sync(probe, "nothing", timeout=0.05, interval=0.01)
    assert len(calls) >= 2


@pytest.mark.parametrize(("what", "timeout", "interval"), [
    ("", 1, 1), (None, 1, 1), ("x", 0, 1), ("x", -1, 1), ("x", True, 1), ("x", 1, "1")])
def test_bad_arguments_are_refused(what: object, timeout: object, interval: object) -> None:
    with pytest.raises(TypeError):
        wait_until_sync(lambda: True, what, timeout=timeout, interval=interval)  # type: ignore[arg-type]
