"""`UntilNone`: an async iterator over a coroutine that answers None at the end.

The exec client's events and an HTTP exchange's body chunks are both read by a
"next, or None when there is no more" call; iterating one is this class, not an async
generator, so a loop broken early leaves nothing for the garbage collector to finish.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class UntilNone(Generic[T]):
    """Iterates ``await next_item()`` until it gives None."""

    def __init__(self, next_item: Callable[[], Awaitable[T | None]]) -> None:
        self._next_item = next_item

    def __aiter__(self) -> UntilNone[T]:
        return self

    async def __anext__(self) -> T:
        item = await self._next_item()
        if item is None:
            raise StopAsyncIteration
        return item
