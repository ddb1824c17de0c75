"""A guest process as the host sees it: its stdin, stdout and stderr as trio streams.

Stream bytes are flow-controlled by credit (docs/guest-protocol.md, "Flow control"): the
guest sends at most a window of output the host has not consumed yet, and the host
sends at most the stdin window the guest granted.  Credit for output goes back when the
caller *consumes* bytes, not when they arrive, so a slow reader stops the process in
the guest instead of filling memory on either side.
"""

from __future__ import annotations

import collections
from typing import Any, Protocol

import trio

from kibotos.core.errors import FailedPrecondition, KibotosError
from kibotos.guest.kibotos_guest.runtime.framing import DATA_CHUNK, encode_control, encode_data
from kibotos.guest.model import ExitStatus


class GuestProtocolViolation(Exception):
    """The guest broke the protocol; the channel cannot be trusted any further."""


class StreamHost(Protocol):
    """What a stream needs from its channel (kept narrow to avoid an import cycle)."""

    def _send_nowait(self, frame: bytes) -> None: ...

    async def _request(self, kind: str, fields: dict[str, Any]) -> dict[str, Any]: ...


#: The most `GuestOutputStream.receive_some` returns when not told (a few frames).
RECEIVE_COALESCE = 256 * 1024


class GuestOutputStream(trio.abc.ReceiveStream):
    """stdout or stderr (or a pty's output) of a guest process."""

    def __init__(self, host: StreamHost, stream_id: int, window: int) -> None:
        self._host = host
        self.stream_id = stream_id
        self._window = window
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._unreturned = 0
        self._eof = False
        self._closed = False
        self._error: KibotosError | None = None
        self._changed = trio.Event()
        self._busy = False

    def _feed(self, data: bytes, eof: bool) -> None:
        if self._buffered + len(data) > self._window:
            raise GuestProtocolViolation(
                f"guest sent {self._buffered + len(data)} bytes on stream {self.stream_id}, "
                f"beyond its window of {self._window}"
            )
        if self._closed:  # nobody reads: keep the process going, drop its output
            self._grant(len(data))
        elif data:
            self._chunks.append(data)
            self._buffered += len(data)
        self._eof = self._eof or eof
        self._changed.set()

    def _fail(self, error: KibotosError) -> None:
        if not self._eof:
            self._error = error
            self._changed.set()

    def _grant(self, amount: int) -> None:
        self._unreturned += amount
        if self._unreturned >= max(1, self._window // 4) and not self._eof:
            self._host._send_nowait(
                encode_control({"type": "window", "stream": self.stream_id,
                                "bytes": self._unreturned})
            )
            self._unreturned = 0

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._busy:
            raise trio.BusyResourceError("another task is already receiving on this stream")
        self._busy = True
        try:
            while not self._chunks:
                if self._closed:
                    raise trio.ClosedResourceError("this stream was closed")
                if self._eof:
                    await trio.lowlevel.checkpoint()
                    return b""
                if self._error is not None:
                    raise trio.BrokenResourceError(str(self._error)) from self._error
                self._changed = trio.Event()
                await self._changed.wait()
            chunk = self._take(RECEIVE_COALESCE if max_bytes is None else max_bytes)
            self._buffered -= len(chunk)
            self._grant(len(chunk))
            await trio.lowlevel.checkpoint()
            return chunk
        finally:
            self._busy = False

    def _take(self, limit: int) -> bytes:
        """What is buffered, up to `limit` bytes, as one piece: the guest's frames are
        64 KiB, and every piece costs the relay above a send, a syscall and a wake-up
        of its reader, so joining what piled up while the last piece was being sent
        is cheaper than handing the pieces on one by one (it was the largest per-MiB
        cost of a download through the data plane)."""
        chunk = self._chunks.popleft()
        if len(chunk) > limit:
            self._chunks.appendleft(chunk[limit:])
            return chunk[:limit]
        if not self._chunks or len(chunk) + len(self._chunks[0]) > limit:
            return chunk
        pieces, size = [chunk], len(chunk)
        while self._chunks and size + len(self._chunks[0]) <= limit:
            piece = self._chunks.popleft()
            pieces.append(piece)
            size += len(piece)
        return b"".join(pieces)

    async def read_all(self) -> bytes:
        """Everything until EOF (convenience for small outputs)."""
        parts = [chunk async for chunk in self]
        return b"".join(parts)

    async def aclose(self) -> None:
        """Stop reading; later output is discarded so the process is not blocked."""
        self.discard()
        await trio.lowlevel.checkpoint()

    def discard(self) -> None:
        """Stop reading: what is buffered is dropped and credited back, and so is what
        still arrives, so the guest never waits for a reader that is gone."""
        if not self._closed:
            self._closed = True
            self._grant(self._buffered)
            self._chunks.clear()
            self._buffered = 0
            self._changed.set()


class GuestInputStream(trio.abc.SendStream):
    """stdin of a guest process; sends wait for the guest's credit."""

    def __init__(self, host: StreamHost, stream_id: int, is_tty: bool, *,
                 chunk: int = DATA_CHUNK) -> None:
        self._host = host
        self.stream_id = stream_id
        self.is_tty = is_tty
        self._chunk = chunk  # the largest data frame it sends
        self._credit = 0
        self._closed = False
        self._error: BaseException | None = None
        self._changed = trio.Event()
        self._busy = False

    def _add_credit(self, amount: int) -> None:
        self._credit += amount
        self._changed.set()

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._changed.set()

    def _check(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("stdin was closed")
        if self._error is not None:
            raise trio.BrokenResourceError(str(self._error)) from self._error

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._busy:
            raise trio.BusyResourceError("another task is already sending on this stream")
        self._busy = True
        try:
            view = memoryview(data)
            while True:
                self._check()
                if not view:
                    break
                while self._credit <= 0:
                    self._changed = trio.Event()
                    await self._changed.wait()
                    self._check()
                n = min(len(view), self._credit, self._chunk)
                self._host._send_nowait(encode_data(self.stream_id, bytes(view[:n])))
                self._credit -= n
                view = view[n:]
            await trio.lowlevel.checkpoint()
        finally:
            self._busy = False

    async def wait_send_all_might_not_block(self) -> None:
        while self._credit <= 0:
            self._check()
            self._changed = trio.Event()
            await self._changed.wait()
        self._check()

    async def aclose(self) -> None:
        """End of input: the process reads EOF (for a tty, the EOF character)."""
        if not self._closed:
            self._closed = True
            if self._error is None:
                self._host._send_nowait(encode_data(self.stream_id, b"", eof=True))
        await trio.lowlevel.checkpoint()


class GuestProcess:
    """A process the guest agent started for us."""

    def __init__(self, host: StreamHost, process_id: int, pid: int, *, tty: bool,
                 stdin: GuestInputStream | None, stdout: GuestOutputStream | None,
                 stderr: GuestOutputStream | None) -> None:
        self._host = host
        self.process_id = process_id
        self.pid = pid  #: the pid inside the guest, for messages; signal by process_id
        self.tty = tty
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.exit_status: ExitStatus | None = None
        self._error: KibotosError | None = None
        self._done = trio.Event()

    def _set_exit(self, status: ExitStatus) -> None:
        self.exit_status = status
        self._done.set()

    def _fail(self, error: KibotosError) -> None:
        if self.exit_status is None:
            self._error = error
            self._done.set()
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream._fail(error)
        if self.stdin is not None:
            self.stdin._fail(error)

    async def wait(self) -> ExitStatus:
        """Until the process exits.  Output may still be buffered: read it to EOF."""
        await self._done.wait()
        if self.exit_status is None:
            assert self._error is not None
            raise self._error
        return self.exit_status

    async def signal(self, sig: int | str, *, group: bool = False) -> None:
        """Send a signal (number or name such as ``"TERM"``) to it, or to its group."""
        if self.exit_status is not None:
            raise FailedPrecondition(f"guest process {self.process_id} has already exited")
        await self._host._request("signal", {"process": self.process_id, "signal": sig,
                                             "group": group})

    async def resize(self, rows: int, cols: int) -> None:
        """Change the window size of its tty; the process gets SIGWINCH."""
        await self._host._request("resize", {"process": self.process_id, "rows": rows,
                                             "cols": cols})
