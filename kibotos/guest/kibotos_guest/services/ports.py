"""The ``ports`` capability (docs/guest-protocol.md, "Ports"): a TCP connection to a port
on the guest's loopback, carried as one protocol stream with bytes both ways under
credit.  Loaded on the first ``port_open``: `socket` is not on the way to hello.

One stream ID carries both directions.  Host data frames on it are written to the
socket, and credit goes back to the host as bytes reach the kernel; what the guest's
server sends goes to the host as data frames on the same ID, read from the socket only
while the host has granted credit.  So neither side holds more than a window per
direction, and a slow reader at either end stalls the writer at the other instead of
filling anybody's memory.  An EOF frame either way is a half-close: ``shutdown(SHUT_WR)``
here when the host's EOF arrives, an EOF frame to the host when the server shut down
its side.

Once both directions have ended the socket is closed and ``port_end {stream}`` says so:
the stream is forgotten (nothing more can come for it).  A failure (a reset, a write to
a server that closed) is ``port_end {stream, error}``; the stream then stays, dropping
frames still on their way, until the host's ``port_close``.
"""

from __future__ import annotations

import contextlib
import errno
import socket

from ..errors import AgentError, field, int_field, invalid
from ..log import log
from ..runtime.framing import DEFAULT_WINDOW, MAX_PAYLOAD, MAX_WINDOW, credited, encode_data
from ..runtime.loop import get_loop
from ..runtime.tasks import Future, wait_for

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ..core import Agent
    from ..runtime.channel import Channel

#: A connect to the guest's loopback that has not finished by then is given up (a
#: listener whose backlog is full drops SYNs, and connect would wait for minutes).
CONNECT_TIMEOUT = 10.0
LOOPBACK = {"127.0.0.1": socket.AF_INET, "::1": socket.AF_INET6}
#: What an unset ``host`` tries, in order (what "localhost" means in a guest).
DEFAULT_HOSTS = ("127.0.0.1", "::1")
#: Errors that say "this address family is not there", not "nothing listens".
_NO_ADDRESS = {errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.ENETUNREACH}
#: Linux's TCP_QUICKACK (the guests are Linux; Python names it from 3.7 on).
_QUICKACK = getattr(socket, "TCP_QUICKACK", 12)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class PortStream:
    """One TCP connection in the guest as the host's stream `stream_id`."""

    def __init__(self, channel: Channel, stream_id: int, port: int, window: int) -> None:
        self.channel = channel
        self.stream_id = stream_id
        self.port = port
        self.sock: socket.socket | None = None
        self.peer = ""
        self.window = window
        self.out_credit = window  # bytes the host still takes from us
        self.in_credit = 0  # bytes the host may still send us (the window, once open)
        self.started = False
        self.inbuf = bytearray()
        self.in_eof = False  # the host's EOF arrived
        self.shut = False  # ... and reached the socket (shutdown SHUT_WR)
        self.out_eof = False  # the server's EOF reached the host
        self.reading = self.writing = False
        self.failed = self.closed = False
        self.sent = self.received = 0  # to the server, from the server
        self._connected: Future | None = None

    # -- connecting

    async def connect(self, host: str) -> int:
        """Connect to `host` (a loopback address); 0 or the errno."""
        try:
            sock = socket.socket(LOOPBACK[host], socket.SOCK_STREAM | socket.SOCK_NONBLOCK
                                 | socket.SOCK_CLOEXEC)
        except OSError as e:
            return e.errno or errno.EAFNOSUPPORT
        self.sock, self.peer = sock, _address(host, self.port)
        err = sock.connect_ex((host, self.port))
        if err == errno.EINPROGRESS:
            done = self._connected = Future()

            def writable() -> None:
                if not done.done():
                    done.set_result(None)

            get_loop().add_writer(sock.fileno(), writable)
            try:
                await wait_for(done, CONNECT_TIMEOUT)
            except TimeoutError:
                err = errno.ETIMEDOUT
            else:
                err = errno.ECONNABORTED if self.closed else sock.getsockopt(
                    socket.SOL_SOCKET, socket.SO_ERROR)
            finally:
                self._connected = None
                if not self.closed:
                    get_loop().remove_writer(sock.fileno())
        if err and not self.closed:
            sock.close()
            self.sock = None
        elif not err:
            # The host's side sends a stream's bytes as they come (one frame per
            # read): each must reach the server now, not wait behind Nagle for the
            # ACK of the last one, which the server may delay by 40 ms.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return err

    def start(self) -> None:
        """Begin relaying (the answer to ``port_open`` is sent right after)."""
        self.started = True
        self.in_credit = self.window
        self._read_while_credit()

    # -- guest -> host

    def credit(self, amount: int) -> None:
        self.out_credit = credited(self.out_credit, amount, self.stream_id)
        self._read_while_credit()

    def _read_while_credit(self) -> None:
        want = (self.started and self.out_credit > 0 and not self.out_eof
                and not self.failed and not self.closed)
        if want and not self.reading:
            assert self.sock is not None
            get_loop().add_reader(self.sock.fileno(), self._on_readable)
            self.reading = True
        elif not want and self.reading:
            self._stop_reading()

    def _stop_reading(self) -> None:
        if self.reading and self.sock is not None:
            get_loop().remove_reader(self.sock.fileno())
        self.reading = False

    def _on_readable(self) -> None:
        assert self.sock is not None
        try:
            # Frames as large as the protocol allows: a byte stream has no use for
            # small ones, and every frame costs both ends a round of work.
            data = self.sock.recv(min(self.out_credit, MAX_PAYLOAD))
        except BlockingIOError:
            return
        except OSError as e:
            self.fail(e)
            return
        if not data:
            self.out_eof = True
            self._stop_reading()
            self.channel.send_frame(encode_data(self.stream_id, b"", eof=True))
            self._end_if_done()
            return
        # Acknowledge what the server sent at once: a server that leaves Nagle on
        # holds the rest of a reply until its first segment is acknowledged, and a
        # delayed ACK here would cost every kept-alive exchange 40 ms.  Linux turns
        # quick ACKs off again by itself, so it is asked for after every read.
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
        self.out_credit -= len(data)
        self.received += len(data)
        self.channel.send_frame(encode_data(self.stream_id, data))
        if self.out_credit <= 0:
            self._stop_reading()

    # -- host -> guest

    def on_data(self, data: bytes, eof: bool) -> None:
        if self.failed:
            return  # on its way before the host learnt of the failure: dropped
        if self.in_eof:
            raise invalid(f"data: stream {self.stream_id} already had its EOF")
        if len(data) > self.in_credit:
            raise invalid(f"data: {len(data)} bytes for stream {self.stream_id} exceed its "
                          f"credit of {self.in_credit}")
        self.in_credit -= len(data)
        self.inbuf += data
        self.in_eof = eof
        self._flush()

    def _flush(self) -> None:
        sock = self.sock
        assert sock is not None
        written = 0
        while self.inbuf:
            try:
                n = sock.send(self.inbuf)
            except BlockingIOError:
                break
            except OSError as e:  # EPIPE, ECONNRESET: the server has gone
                self.fail(e)
                return
            del self.inbuf[:n]
            written += n
        if written:
            self.sent += written
            self.in_credit += written
            self.channel.send_control({"type": "window", "stream": self.stream_id,
                                       "bytes": written})
        if self.inbuf and not self.writing:
            get_loop().add_writer(sock.fileno(), self._flush)
            self.writing = True
        elif not self.inbuf:
            if self.writing:
                get_loop().remove_writer(sock.fileno())
                self.writing = False
            if self.in_eof and not self.shut:
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError as e:
                    self.fail(e)
                    return
                self.shut = True
                self._end_if_done()

    # -- the end

    def _end_if_done(self) -> None:
        if self.shut and self.out_eof and not self.closed:
            self._close_socket()
            self.channel.streams.pop(self.stream_id, None)
            self.channel.send_control({"type": "port_end", "stream": self.stream_id,
                                       "sent": self.sent, "received": self.received})

    def fail(self, e: OSError) -> None:
        """The connection broke: tell the host, keep the stream until its port_close."""
        if self.failed or self.closed:
            return
        self.failed = True
        self._close_socket()
        reset = e.errno in (errno.ECONNRESET, errno.EPIPE)
        what = ("the connection was reset by the guest's server" if reset
                else f"the connection failed: {e.strerror or e}")
        log.debug("port %s (stream %s): %s", self.peer, self.stream_id, what)
        self.channel.send_control({
            "type": "port_end", "stream": self.stream_id, "sent": self.sent,
            "received": self.received,
            "error": {"code": "unavailable", "message": f"port {self.peer}: {what}",
                      "details": {"port": self.port,
                                  "reason": "reset" if reset else "failed",
                                  "errno": errno.errorcode.get(e.errno or 0, "")}}})

    def _close_socket(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._stop_reading()
        sock, self.sock = self.sock, None
        if sock is not None:
            if self.writing:
                get_loop().remove_writer(sock.fileno())
                self.writing = False
            if self._connected is not None:
                get_loop().remove_writer(sock.fileno())
                if not self._connected.done():
                    self._connected.set_result(None)
            sock.close()
        self.inbuf.clear()

    def detach(self) -> None:
        """The host's session ended: the connection goes with it."""
        self._close_socket()


async def port_open(agent: Agent, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    port = int_field(msg, "port", 1, 65535)
    host = field(msg, "host", str, None)
    if host is not None and host not in LOOPBACK:
        raise invalid(f"port_open: host must be one of {sorted(LOOPBACK)} (the guest's "
                      f"loopback), not {host!r}")
    sid = int_field(msg, "stream", 1, 2**32 - 1)
    window = int_field(msg, "window", 1, MAX_WINDOW, DEFAULT_WINDOW)
    if sid in ch.streams or sid in ch.transfers:
        raise invalid(f"port_open: stream {sid} is already in use")
    stream = PortStream(ch, sid, port, window)
    ch.streams[sid] = stream  # reserved while connecting; detach closes it
    session = ch.session
    tried: list[tuple[str, int]] = []
    try:
        for candidate in (host,) if host is not None else DEFAULT_HOSTS:
            err = await stream.connect(candidate)
            if stream.closed or ch.session != session:
                raise AgentError("unavailable", "port_open: the host's session ended")
            if not err:
                break
            tried.append((candidate, err))
            if err != errno.ECONNREFUSED and err not in _NO_ADDRESS:
                break
        else:
            err = -1
        if err:
            raise _connect_error(port, tried)
    except BaseException:
        stream.detach()
        if ch.streams.get(sid) is stream:
            del ch.streams[sid]
        raise
    stream.start()  # its first frame can only follow this answer
    return {"stream_window": window, "address": stream.peer}


def _connect_error(port: int, tried: list[tuple[str, int]]) -> AgentError:
    refused = [h for h, e in tried if e == errno.ECONNREFUSED]
    if refused:
        on = " and ".join(refused)
        return AgentError("unavailable", f"port_open: nothing listens on port {port} in the "
                          f"guest (connection refused on {on})",
                          {"port": port, "reason": "connection_refused", "addresses": refused})
    host, err = tried[-1]
    if err == errno.ETIMEDOUT:
        return AgentError("deadline_exceeded", f"port_open: connecting to "
                          f"{_address(host, port)} did not finish within "
                          f"{CONNECT_TIMEOUT:g}s", {"port": port, "reason": "timeout"})
    import os

    return AgentError("unavailable", f"port_open: connecting to {_address(host, port)}: "
                      f"{os.strerror(err)}", {"port": port, "reason": "failed",
                                              "errno": errno.errorcode.get(err, "")})


def port_close(agent: Agent, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    """The host is done with the stream (aborted, or after a failure)."""
    sid = int_field(msg, "stream", 1, 2**32 - 1)
    stream = ch.streams.get(sid)
    if not isinstance(stream, PortStream):
        return {"closed": False}  # ended on its own already
    was_open = not stream.closed
    stream.detach()
    del ch.streams[sid]
    return {"closed": was_open}
