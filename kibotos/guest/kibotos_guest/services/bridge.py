"""Streams between a transfer's worker thread and the loop, under the host's credit.

File transfers do their reading and writing in a worker thread: a read from a stuck
disk (or an NFS mount gone away) must not stop the loop that answers exec, ping and
stop_prepare.  The thread sees plain blocking file objects; the loop sees protocol
streams under credit (docs/guest-protocol.md, "Flow control"):

* `Outbound` (guest → host): `write` blocks the thread until the host has granted
  credit, so a host that reads slowly stops the thread, and the agent holds no more
  than one window per stream;
* `Inbound` (host → guest): `read` blocks the thread until bytes arrive; credit goes
  back to the host as the thread consumes them.

`Transfer` is the worker thread itself, with the two moments the loop waits for.
Both streams keep a sha256 of every byte that passed, the digest checked at the end of a
transfer.  `cancel` (the host's ``transfer_cancel``, or its session ending) makes the
thread's next `read` or `write` raise `Cancelled`.
"""

from __future__ import annotations

import collections
import hashlib
import threading

from ..errors import AgentError, int_field, invalid
from ..log import log
from ..runtime.framing import DATA_CHUNK, credited, encode_data
from ..runtime.loop import get_loop
from ..runtime.tasks import Future
from .fileinfo import os_error

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ..core import Agent
    from ..runtime.channel import Channel

    Body = Callable[[], dict[str, Any]]


class Cancelled(Exception):
    """The transfer was cancelled by the host or its session ended."""


class _Bridge:
    def __init__(self, channel: Channel, stream_id: int) -> None:
        self.channel = channel
        self.session = channel.session
        self.stream_id = stream_id
        self.loop = get_loop()
        self.cond = threading.Condition()
        self.cancelled: str | None = None
        self.digest = hashlib.sha256()
        self.count = 0

    def cancel(self, why: str) -> None:
        """From the loop or the thread: the next read or write raises `Cancelled`."""
        with self.cond:
            if self.cancelled is None:
                self.cancelled = why
            self.cond.notify_all()

    def detach(self) -> None:
        self.cancel("the host's session ended")

    def _check(self) -> None:  # with the lock held
        if self.cancelled is not None:
            raise Cancelled(self.cancelled)

    def check_cancelled(self) -> None:
        """From the thread: raise `Cancelled` if the transfer was cancelled."""
        with self.cond:
            self._check()

    def _post(self, frame: bytes) -> None:
        """From the thread: send `frame` on the loop, if the session is still ours."""
        self.loop.call_soon_threadsafe(self._send, frame)

    def _send(self, frame: bytes) -> None:
        if self.channel.session == self.session:
            self.channel.send_frame(frame)

    def hexdigest(self) -> str:
        return "sha256:" + self.digest.hexdigest()


class Outbound(_Bridge):
    """Bytes the thread produces, sent to the host within its credit.

    The credit starts at zero: `open` grants the host's window once the request's
    answer is on its way, so no data frame can overtake the answer.
    """

    def __init__(self, channel: Channel, stream_id: int) -> None:
        super().__init__(channel, stream_id)
        self.window = 0
        self._pending = bytearray()

    def open(self, window: int) -> None:
        self.credit(window)

    def credit(self, amount: int) -> None:
        """The host's ``window`` message (on the loop)."""
        with self.cond:
            self.window = credited(self.window, amount, self.stream_id)
            self.cond.notify_all()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """From the thread: queue `data`; full frames go out as credit allows."""
        size = len(data)
        self.digest.update(data)
        self.count += size
        self._pending += data
        while len(self._pending) >= DATA_CHUNK:
            self._flush(DATA_CHUNK)
        return size

    def _flush(self, limit: int) -> None:
        while self._pending:
            with self.cond:
                while self.window <= 0 and self.cancelled is None:
                    self.cond.wait()
                self._check()
                n = min(self.window, limit, len(self._pending))
                self.window -= n
            chunk = bytes(self._pending[:n])
            del self._pending[:n]
            self._post(encode_data(self.stream_id, chunk))
            if len(self._pending) < limit:
                return

    def push(self) -> None:
        """From the thread: send what is queued now, though less than a frame (a
        stream of events must not wait for a full chunk)."""
        while self._pending:
            self._flush(DATA_CHUNK)

    def finish(self) -> None:
        """From the thread: send what is left and the EOF frame."""
        self.push()
        with self.cond:
            self._check()
        self._post(encode_data(self.stream_id, b"", eof=True))

    def flush(self) -> None:  # file-object protocol (tarfile calls it on close)
        return


class Inbound(_Bridge):
    """Bytes from the host, read by the thread; credit returns as the thread reads.

    `outstanding` (loop only) is what the host may still send: a data frame beyond it
    is a protocol violation.  Credit is given back in quarters of the window, and all
    of it before the thread waits for more, so the host is never left without credit
    while the thread starves.
    """

    def __init__(self, channel: Channel, stream_id: int, window: int) -> None:
        super().__init__(channel, stream_id)
        self.window = window
        self.outstanding = window
        self._chunks: collections.deque[bytes] = collections.deque()
        self._eof = False
        self._broken = False
        self._unreturned = 0
        self.commit_digest: str | None = None
        self.committed = False

    # -- the loop's side

    def on_data(self, data: bytes, eof: bool) -> None:
        if len(data) > self.outstanding:
            raise invalid(f"data: {len(data)} bytes for stream {self.stream_id} exceed its "
                          f"credit of {self.outstanding}")
        self.outstanding -= len(data)
        with self.cond:
            if self._broken:  # the transfer failed: discard, but give the credit back
                self._return(len(data))
                return
            if data:
                self._chunks.append(data)
            self._eof = self._eof or eof
            self.cond.notify_all()

    def commit(self, digest: str | None) -> None:
        """``transfer_commit``: the input is complete (it implies EOF)."""
        with self.cond:
            self.commit_digest = digest
            self.committed = True
            self._eof = True
            self.cond.notify_all()

    def _return(self, amount: int) -> None:  # on the loop
        if amount <= 0 or self.channel.session != self.session:
            return
        self.outstanding += amount
        self.channel.send_control({"type": "window", "stream": self.stream_id,
                                   "bytes": amount})

    # -- the thread's side

    def read(self, size: int = -1) -> bytes:
        """Up to `size` bytes (any amount for -1); b"" at EOF."""
        with self.cond:
            while not self._chunks and not self._eof and self.cancelled is None:
                if self._unreturned:
                    self.loop.call_soon_threadsafe(self._return, self._unreturned)
                    self._unreturned = 0
                self.cond.wait()
            self._check()
            if not self._chunks:
                return b""
            chunk = self._chunks.popleft()
            if 0 <= size < len(chunk):
                chunk, rest = chunk[:size], chunk[size:]
                self._chunks.appendleft(rest)
            self._unreturned += len(chunk)
            if self._unreturned >= max(1, self.window // 4):
                self.loop.call_soon_threadsafe(self._return, self._unreturned)
                self._unreturned = 0
        self.digest.update(chunk)
        self.count += len(chunk)
        return chunk

    def fail(self) -> None:
        """From the thread: nothing more will be read; later data is discarded."""
        with self.cond:
            self._broken = True
            dropped = sum(len(c) for c in self._chunks) + self._unreturned
            self._chunks.clear()
            self._unreturned = 0
        self.loop.call_soon_threadsafe(self._return, dropped)

    def wait_commit(self) -> str | None:
        """From the thread, after EOF: until ``transfer_commit`` (its digest, if any)."""
        with self.cond:
            while not self.committed and self.cancelled is None:
                self.cond.wait()
            self._check()
            return self.commit_digest


def check_digest(expected: str | None, bridge: _Bridge, what: str, path: str) -> None:
    """Refuse a transfer whose bytes do not hash to what the host sent."""
    if expected is None:
        return
    actual = bridge.hexdigest()
    if expected.lower() != actual:
        raise AgentError("invalid_argument",
                         f"{what} {path}: the {bridge.count} bytes received have "
                         f"{actual}, not the {expected} the host sent; nothing was written",
                         {"reason": "digest_mismatch", "path": path, "sha256": actual})


class Transfer:
    """One transfer's worker thread; `ready` settles after prepare, `done` after the
    body (each with a result dict or an `AgentError`)."""

    def __init__(self, ch: Channel, bridge: Inbound | Outbound, what: str, path: str) -> None:
        self.ch = ch
        self.bridge = bridge
        self.what = what
        self.path = path
        self.ready = Future()
        self.done = Future()

    def start(self, prepare: Body, body: Body, cleanup: Callable[[], None]) -> None:
        self.ch.transfers[self.bridge.stream_id] = self
        self.ch.streams[self.bridge.stream_id] = self.bridge
        threading.Thread(target=self._main, args=(prepare, body, cleanup), daemon=True,
                         name=f"kibotos-guest {self.what}").start()

    def _main(self, prepare: Body, body: Body, cleanup: Callable[[], None]) -> None:
        step = self.ready
        try:
            answer = prepare()
            self._settle(self.ready, answer, None)
            step = self.done
            outcome = body()
        except BaseException as e:
            try:
                cleanup()
            except Exception as second:
                log.warning("%s %s: cleaning up: %s", self.what, self.path, second)
            error = self._error(e, wrote=step is self.done)
            if step is self.ready:
                self._settle(self.ready, None, error)
            self._settle(self.done, None, error)
            return
        self._settle(self.done, outcome, None)

    def _error(self, e: BaseException, *, wrote: bool) -> AgentError:
        if isinstance(e, AgentError):
            return e
        if isinstance(e, Cancelled):
            return AgentError("failed_precondition", f"{self.what} {self.path}: cancelled "
                              f"({e}); nothing was written", {"reason": "cancelled"})
        if isinstance(e, OSError):
            err = os_error(e, self.what, self.path)
            if wrote and self.what in ("file_write", "tar_write"):
                err.message += "; nothing was written under the target name"
            return err
        log.error("%s %s failed", self.what, self.path, exc_info=e)
        return AgentError("internal", f"{self.what} {self.path}: {type(e).__name__}: {e}")

    def _settle(self, fut: Future, value: Any, exc: AgentError | None) -> None:
        def settle() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)

        self.bridge.loop.call_soon_threadsafe(settle)

    def forget(self) -> None:
        if self.ch.streams.get(self.bridge.stream_id) is self.bridge:
            del self.ch.streams[self.bridge.stream_id]
        if self.ch.transfers.get(self.bridge.stream_id) is self:
            del self.ch.transfers[self.bridge.stream_id]


def stream_id_field(ch: Channel, msg: dict[str, Any]) -> int:
    sid: int = int_field(msg, "stream", 1, 2**32 - 1)
    if sid in ch.streams or sid in ch.transfers:
        raise invalid(f"{msg['type']}: stream {sid} is already open")
    return sid


def writable(agent: Agent, what: str) -> None:
    if agent.stopping:
        raise AgentError("failed_precondition", f"{what}: the guest is prepared for stop "
                         "and its file systems are frozen; send thaw first")
