"""Exponential backoff with jitter, for reaching ctrl again after a failure.

Jitter matters here: when ctrl restarts, every node loses its session at the same
moment, and without it they would all knock again in lockstep.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Delays that double from `initial` up to `cap`, each drawn from [d/2, d]."""

    initial: float = 0.5
    cap: float = 10.0
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0

    def next_delay(self) -> float:
        nominal = min(self.cap, self.initial * (2 ** min(self.attempt, 32)))
        self.attempt += 1
        return self.rng.uniform(nominal / 2, nominal)

    def reset(self) -> None:
        """After a success: the next failure starts again from `initial`."""
        self.attempt = 0
