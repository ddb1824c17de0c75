"""Reconnect delays: doubling from 0.5 s to a 10 s cap, jittered, reset on success."""

from __future__ import annotations

import random

from kibotos.node.session.backoff import Backoff


def test_delays_double_up_to_the_cap_with_jitter() -> None:
    backoff = Backoff(rng=random.Random(1))
    nominal = [0.5, 1, 2, 4, 8, 10, 10, 10]
    delays = [backoff.next_delay() for _ in nominal]
    for delay, top in zip(delays, nominal, strict=True):
        assert top / 2 <= delay <= top
    assert len(set(delays)) == len(delays)  # jittered, not lockstep


def test_reset_starts_again_from_the_initial_delay() -> None:
    backoff = Backoff(rng=random.Random(2))
    for _ in range(10):
        backoff.next_delay()
    backoff.reset()
    assert backoff.next_delay() <= 0.5
