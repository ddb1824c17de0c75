"""At most one background task per object: the guard ctrl's resumable tasks share
(Workspace stop and delete, Volume create and delete, object operations).

The sweep and the API may both ask for the same object's task (a ctrl start resumes
what a request also spawned); a second task for the same object would race the first
through the same store rows, so the later one returns at once and the running one
carries on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class SingleFlight(Generic[K]):
    """The keys whose task runs now."""

    def __init__(self) -> None:
        self._running: set[K] = set()

    def __contains__(self, key: K) -> bool:
        return key in self._running

    async def run(self, key: K, task: Callable[[], Awaitable[None]],
                  after: Callable[[], None] | None = None) -> None:
        """Run `task` unless one for `key` runs already; `after` runs once the task
        ends (also by an error), and only when the task ran."""
        if key in self._running:
            return
        self._running.add(key)
        try:
            await task()
        finally:
            self._running.discard(key)
            if after is not None:
                after()
