"""A small event loop on epoll: what the agent used of asyncio, and no more.

Why not asyncio: importing it (ssl, inspect, concurrent.futures, logging…) took ~0.5 s
of the agent's start in a TCG guest, for a program that needs only readers and writers
on descriptors, timers, signals, blocking calls in worker threads, and a few coroutines
(configure, stop_prepare, sync).  This module gives exactly that, with asyncio's
semantics where the agent relies on them:

* callbacks run one at a time on the loop's thread; one that raises is logged and the
  loop goes on;
* a reader or writer that is removed before its turn in the same iteration does not run
  (handles are cancelled, as asyncio's are);
* signals arrive through ``signal.set_wakeup_fd`` and their handlers run as ordinary
  callbacks, never in the middle of other code;
* `wait_for` does not cancel what it waited for (the agent always shielded: a freeze
  that finishes late must still be recorded).

Coroutines, futures and tasks are in `tasks`.
"""

from __future__ import annotations

import collections
import heapq
import os
import select
import signal
import time

from ..log import log

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from typing import Any

_READ = select.EPOLLIN | select.EPOLLPRI | select.EPOLLHUP | select.EPOLLERR
_WRITE = select.EPOLLOUT | select.EPOLLHUP | select.EPOLLERR
_THREAD_WAKEUP = b"\0"  # signal numbers are never 0
_current: Loop | None = None


def get_loop() -> Loop:
    """The running loop (there is one per `Loop.run`)."""
    if _current is None:
        raise RuntimeError("no kibotos-guest loop is running")
    return _current


class Handle:
    """A scheduled callback; `cancel` keeps it from running."""

    __slots__ = ("args", "callback", "cancelled")

    def __init__(self, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def run(self) -> None:
        try:
            self.callback(*self.args)
        except Exception as e:
            log.error("exception in callback %r", self.callback, exc_info=e)


class Loop:
    """Readers, writers, timers, signals and thread completions, dispatched from epoll."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._masks: dict[int, int] = {}
        self._readers: dict[int, Handle] = {}
        self._writers: dict[int, Handle] = {}
        self._ready: collections.deque[Handle] = collections.deque()
        self._timers: list[tuple[float, int, Handle]] = []
        self._seq = 0
        self._signals: dict[int, Handle] = {}
        self._saved_signals: dict[int, Any] = {}
        self._saved_wakeup_fd: int | None = None
        self._threadsafe: collections.deque[Handle] = collections.deque()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._closed = False

    @staticmethod
    def time() -> float:
        return time.monotonic()

    # -- callbacks and timers

    def call_soon(self, callback: Callable[..., object], *args: Any) -> Handle:
        handle = Handle(callback, args)
        self._ready.append(handle)
        return handle

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Handle:
        handle = Handle(callback, args)
        self._seq += 1
        heapq.heappush(self._timers, (time.monotonic() + max(0.0, delay), self._seq, handle))
        return handle

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: Any) -> None:
        """From any thread: run `callback` on the loop (deque appends are atomic)."""
        if self._closed:
            return  # a worker that outlived its loop: its descriptor may be reused now
        self._threadsafe.append(Handle(callback, args))
        try:
            os.write(self._wake_w, _THREAD_WAKEUP)
        except OSError:
            return  # a full pipe already wakes the loop; a closed one has no loop to wake

    # -- descriptors

    def _update(self, fd: int) -> None:
        mask = (select.EPOLLIN if fd in self._readers else 0) | (
            select.EPOLLOUT if fd in self._writers else 0)
        old = self._masks.get(fd, 0)
        if mask == old:
            return
        if not mask:
            del self._masks[fd]
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):
                return  # already closed: the kernel dropped it
            return
        if old:
            self._epoll.modify(fd, mask)
        else:
            self._epoll.register(fd, mask)
        self._masks[fd] = mask

    def add_reader(self, fd: int, callback: Callable[[], object]) -> None:
        old = self._readers.pop(fd, None)
        if old is not None:
            old.cancel()
        self._readers[fd] = Handle(callback, ())
        try:
            self._update(fd)
        except BaseException:
            del self._readers[fd]
            raise

    def remove_reader(self, fd: int) -> None:
        handle = self._readers.pop(fd, None)
        if handle is not None:
            handle.cancel()
            self._update(fd)

    def add_writer(self, fd: int, callback: Callable[[], object]) -> None:
        old = self._writers.pop(fd, None)
        if old is not None:
            old.cancel()
        self._writers[fd] = Handle(callback, ())
        try:
            self._update(fd)
        except BaseException:
            del self._writers[fd]
            raise

    def remove_writer(self, fd: int) -> None:
        handle = self._writers.pop(fd, None)
        if handle is not None:
            handle.cancel()
            self._update(fd)

    # -- signals

    def add_signal_handler(self, sig: int, callback: Callable[[], object]) -> None:
        if self._saved_wakeup_fd is None:
            self._saved_wakeup_fd = signal.set_wakeup_fd(self._wake_w,
                                                         warn_on_full_buffer=False)
        self._signals[sig] = Handle(callback, ())
        # The C handler writes the number to the wakeup fd; `_ignore` runs later, idle.
        old = signal.signal(sig, _ignore)
        self._saved_signals.setdefault(sig, old)
        signal.siginterrupt(sig, False)  # SA_RESTART, as asyncio does: fewer EINTRs

    def _drain_wakeups(self) -> None:
        while True:
            try:
                data = os.read(self._wake_r, 4096)
            except BlockingIOError:
                break
            if not data:
                break
            for sig in set(data) - {0}:
                handle = self._signals.get(sig)
                if handle is not None:
                    self._ready.append(handle)
        while self._threadsafe:
            self._ready.append(self._threadsafe.popleft())

    # -- running

    def _run_once(self) -> None:
        timers = self._timers
        while timers and timers[0][2].cancelled:
            heapq.heappop(timers)
        timeout = -1.0
        if self._ready:
            timeout = 0.0
        elif timers:
            timeout = max(0.0, timers[0][0] - time.monotonic())
        for fd, events in self._epoll.poll(timeout):
            if fd == self._wake_r:
                self._drain_wakeups()
                continue
            if events & _READ and fd in self._readers:
                self._ready.append(self._readers[fd])
            if events & _WRITE and fd in self._writers:
                self._ready.append(self._writers[fd])
        now = time.monotonic()
        while timers and timers[0][0] <= now:
            handle = heapq.heappop(timers)[2]
            if not handle.cancelled:
                self._ready.append(handle)
        for _ in range(len(self._ready)):
            handle = self._ready.popleft()
            if not handle.cancelled:
                handle.run()

    def run(self, main: Coroutine[Any, Any, Any]) -> Any:
        """Run until `main` finishes; return its result or raise its exception.  The loop
        is closed afterwards (signal handlers restored, descriptors closed)."""
        global _current
        if _current is not None:
            raise RuntimeError("a kibotos-guest loop is already running")
        _current = self
        try:
            from .tasks import Task

            task = Task(main)
            while not task.done():
                self._run_once()
            return task.result()
        finally:
            _current = None
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sig, old in self._saved_signals.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        if self._saved_wakeup_fd is not None:
            signal.set_wakeup_fd(self._saved_wakeup_fd)
        self._epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _ignore(signum: int, frame: object) -> None:
    """The Python-level handler: the wakeup fd already told the loop."""
