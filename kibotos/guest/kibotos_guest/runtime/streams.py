"""A process's stdin and output as protocol streams, moved under credit.

Neither end buffers more than a window per stream (docs/guest-protocol.md, "Flow
control"): output is read from the pipe only while the host has granted credit, so a
fast producer blocks on its own full pipe instead of filling the agent's memory; stdin
credit goes back to the host as bytes reach the pipe.
"""

from __future__ import annotations

import errno
import os

from ..errors import invalid
from ..log import log
from .framing import DATA_CHUNK, credited, encode_data
from .loop import get_loop

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..services.processes import ManagedProcess
    from .channel import Channel


class OutputStream:
    """Process output (a pipe or a pty master) sent to the host within its credit window.

    Detached with ``on_detach: keep`` (`channel` None), it is read and dropped, so the
    process never blocks on a full pipe nobody reads.
    """

    def __init__(self, channel: Channel, stream_id: int, fd: int, window: int,
                 proc: ManagedProcess) -> None:
        self.channel: Channel | None = channel
        self.stream_id = stream_id
        self.fd = fd
        self.window = window
        self.proc = proc
        self.reading = False
        self.closed = False
        os.set_blocking(fd, False)

    def start(self) -> None:
        if not self.closed and not self.reading and (self.window > 0 or self.channel is None):
            get_loop().add_reader(self.fd, self._on_readable)
            self.reading = True

    def _pause(self) -> None:
        if self.reading:
            get_loop().remove_reader(self.fd)
            self.reading = False

    def _on_readable(self) -> None:
        size = DATA_CHUNK if self.channel is None else min(self.window, DATA_CHUNK)
        try:
            data = os.read(self.fd, size)
        except BlockingIOError:
            return
        except OSError as e:  # EIO: every slave side of a pty has closed
            if e.errno != errno.EIO:
                log.warning("reading output of process %s: %s", self.proc.process_id, e)
            data = b""
        if not data:
            self.close(send_eof=True)
            return
        if self.channel is None:  # detached with on_detach=keep: drain and drop
            return
        self.window -= len(data)
        self.channel.send_frame(encode_data(self.stream_id, data))
        if self.window <= 0:
            self._pause()

    def credit(self, amount: int) -> None:
        self.window = credited(self.window, amount, self.stream_id)
        self.start()

    def detach(self) -> None:
        if self.proc.on_detach == "keep" and not self.closed:
            self.channel = None
            self.start()
        else:
            self.close(send_eof=False)

    def close(self, *, send_eof: bool) -> None:
        if self.closed:
            return
        self._pause()
        self.closed = True
        os.close(self.fd)
        if self.channel is not None:
            if send_eof:
                self.channel.send_frame(encode_data(self.stream_id, b"", eof=True))
            self.channel.streams.pop(self.stream_id, None)


class InputStream:
    """Host bytes for a process's stdin (a pipe or a pty master), buffered within credit.

    The host may have at most `window` bytes unwritten here; credit goes back to the host
    as bytes reach the pipe, so the agent never holds more than one window per stream.
    """

    def __init__(self, channel: Channel, stream_id: int, fd: int, window: int,
                 is_tty: bool) -> None:
        self.channel = channel
        self.stream_id = stream_id
        self.fd = fd
        self.window = window
        self.is_tty = is_tty
        self.buf = bytearray()
        self.eof = False
        self.broken = False
        self.writing = False
        os.set_blocking(fd, False)

    def on_data(self, data: bytes, eof: bool) -> None:
        if len(data) > self.window:
            raise invalid(f"data: {len(data)} bytes for stream {self.stream_id} exceed its "
                          f"credit of {self.window}")
        if self.broken:  # the process closed its stdin: discard, but give the credit back
            self._return_credit(len(data))
            return
        self.window -= len(data)
        self.buf += data
        self.eof = self.eof or eof
        self.flush()

    def flush(self) -> None:
        written = 0
        while self.buf:
            try:
                n = os.write(self.fd, self.buf[:DATA_CHUNK])
            except BlockingIOError:
                break
            except OSError:  # EPIPE: the reader has gone
                self._broken()
                return
            del self.buf[:n]
            written += n
        if written:
            self.window += written
            self._return_credit(written)
        loop = get_loop()
        if self.buf and not self.writing:
            loop.add_writer(self.fd, self.flush)
            self.writing = True
        elif not self.buf:
            if self.writing:
                loop.remove_writer(self.fd)
                self.writing = False
            if self.eof:
                self._finish_eof()

    def _return_credit(self, amount: int) -> None:
        self.channel.send_control({"type": "window", "stream": self.stream_id, "bytes": amount})

    def _finish_eof(self) -> None:
        if self.is_tty:  # a pty cannot be half-closed: send the EOF character instead
            import termios

            try:
                os.write(self.fd, termios.tcgetattr(self.fd)[6][termios.VEOF])
            except OSError as e:  # the terminal is gone already
                log.debug("EOF to the tty of stream %s: %s", self.stream_id, e)
        self.close()

    def _broken(self) -> None:
        self.broken = True
        if self.buf:
            self._return_credit(len(self.buf))
            self.window += len(self.buf)
            self.buf.clear()
        if self.writing:
            get_loop().remove_writer(self.fd)
            self.writing = False
        self.channel.send_control({"type": "stream_closed", "stream": self.stream_id})

    def detach(self) -> None:
        self.close()

    def close(self) -> None:
        if self.fd < 0:
            return
        if self.writing:
            get_loop().remove_writer(self.fd)
            self.writing = False
        os.close(self.fd)
        self.fd = -1
        self.channel.streams.pop(self.stream_id, None)
