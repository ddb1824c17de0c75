"""Futures and tasks on the agent's loop (`loop`): what coroutines await.

Coroutines await `Future` objects only (`sleep`, `run_in_thread`, `wait_for`, `Lock` and
`Event` all produce them); a `Task` drives one coroutine, resuming it when the future it
waits for is done.  There is no cancellation: the agent never cancels work, and
`wait_for` leaves what it waited for running (a freeze that finishes late must still be
recorded).
"""

from __future__ import annotations

import collections

from .loop import get_loop

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Generator
    from typing import Any



class Future:
    """A result that arrives later; awaiting it suspends the coroutine until then."""

    def __init__(self) -> None:
        self._loop = get_loop()
        self._done = False
        self._result: Any = None
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[[Future], object]] = []

    def done(self) -> bool:
        return self._done

    def result(self) -> Any:
        if not self._done:
            raise RuntimeError("the future has no result yet")
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self) -> BaseException | None:
        if not self._done:
            raise RuntimeError("the future has no result yet")
        return self._exception

    def _finish(self) -> None:
        self._done = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            self._loop.call_soon(callback, self)

    def set_result(self, value: Any) -> None:
        if self._done:
            raise RuntimeError("the future is already done")
        self._result = value
        self._finish()

    def set_exception(self, exc: BaseException) -> None:
        if self._done:
            raise RuntimeError("the future is already done")
        self._exception = exc
        self._finish()

    def add_done_callback(self, callback: Callable[[Future], object]) -> None:
        """`callback(self)` runs on the loop once done (soon, if it already is)."""
        if self._done:
            self._loop.call_soon(callback, self)
        else:
            self._callbacks.append(callback)

    def __await__(self) -> Generator[Future, None, Any]:
        if not self._done:
            yield self
        return self.result()


class Task(Future):
    """Drives a coroutine: each Future it awaits resumes it when done."""

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        super().__init__()
        self._coro = coro
        self._loop.call_soon(self._step, None, None)

    def _step(self, value: Any, exc: BaseException | None) -> None:
        try:
            yielded = self._coro.throw(exc) if exc is not None else self._coro.send(value)
        except StopIteration as stop:
            self.set_result(stop.value)
            return
        except Exception as e:
            self.set_exception(e)
            return
        if not isinstance(yielded, Future):
            self._coro.close()
            self.set_exception(RuntimeError(f"a task awaited {yielded!r}, not a Future"))
            return
        yielded.add_done_callback(self._wakeup)

    def _wakeup(self, fut: Future) -> None:
        try:
            value = fut.result()
        except BaseException as e:
            self._step(None, e)
        else:
            self._step(value, None)


def create_task(coro: Coroutine[Any, Any, Any]) -> Task:
    return Task(coro)


async def sleep(delay: float) -> None:
    fut = Future()
    handle = get_loop().call_later(delay, _resolve, fut, None)
    try:
        await fut
    finally:
        handle.cancel()


def _resolve(fut: Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


async def wait_for(fut: Future, timeout: float) -> Any:
    """`fut`'s result, or TimeoutError after `timeout` seconds.  `fut` is not cancelled:
    it goes on, and its outcome is simply not waited for."""
    waiter = Future()

    def expire() -> None:
        if not waiter.done():
            waiter.set_exception(TimeoutError())

    def relay(done: Future) -> None:
        if waiter.done():
            return
        exc = done.exception()
        if exc is not None:
            waiter.set_exception(exc)
        else:
            waiter.set_result(done.result())

    timer = get_loop().call_later(timeout, expire)
    fut.add_done_callback(relay)
    try:
        return await waiter
    finally:
        timer.cancel()


def run_in_thread(func: Callable[..., Any], *args: Any) -> Future:
    """Run a blocking call (mount, syncfs, FIFREEZE) in a new daemon thread, so a stuck
    disk never stops the loop; the Future completes on the loop.  A thread still stuck
    when the agent exits does not hold the exit up."""
    import threading  # only once there is blocking work

    loop = get_loop()
    fut = Future()

    def work() -> None:
        try:
            result = func(*args)
        except BaseException as e:
            loop.call_soon_threadsafe(_settle, fut, None, e)
        else:
            loop.call_soon_threadsafe(_settle, fut, result, None)

    threading.Thread(target=work, name=f"kibotos-guest {getattr(func, '__name__', 'work')}",
                     daemon=True).start()
    return fut


def _settle(fut: Future, result: Any, exc: BaseException | None) -> None:
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class Event:
    """Set once; `wait` returns when it is."""

    def __init__(self) -> None:
        self._set = False
        self._waiters: list[Future] = []

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        for waiter in self._waiters:
            _resolve(waiter, None)
        self._waiters.clear()

    async def wait(self) -> None:
        if not self._set:
            waiter = Future()
            self._waiters.append(waiter)
            await waiter


class Lock:
    """Mutual exclusion between coroutines, first come first served."""

    def __init__(self) -> None:
        self._locked = False
        self._waiters: collections.deque[Future] = collections.deque()

    async def __aenter__(self) -> None:
        if not self._locked:
            self._locked = True
            return
        waiter = Future()
        self._waiters.append(waiter)
        await waiter  # release() hands the lock over, still locked

    async def __aexit__(self, *exc: object) -> None:
        if self._waiters:
            self._waiters.popleft().set_result(None)
        else:
            self._locked = False
