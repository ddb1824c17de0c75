"""The client end of exec for ``kibo workspace exec``: a socket and wsproto, no trio.

`kibotos.dataplane.client` is the same client on trio and trio-websocket; importing
those two costs about 0.15 s of CPU, more than the rest of a ``kibo`` command, so the
CLI speaks the protocol from one thread over a plain socket instead.  wsproto (the
WebSocket state machine trio-websocket itself runs on) does the framing and the
handshake; `kibotos.dataplane.exec_wire` says what each message means, for both
clients alike.

`connect` blocks until the upgrade is accepted and the request frame is sent; then the
socket is non-blocking and the caller runs the loop (`kibotos.cli.exec_relay`): it
polls `fileno`, calls `receive` when it is readable and `flush` when `wants_write`.
Frames the caller sends (stdin, eof, resize, signal) are queued and written by
`flush`, so a process that floods its output while kibo is sending it input never
deadlocks the two directions; `backlog` says how much is queued, so the caller stops
reading its stdin while the data plane is not taking it.
"""

from __future__ import annotations

import socket
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import RemoteProtocolError

from kibotos.dataplane import exec_wire
from kibotos.dataplane.exec_wire import MAX_MESSAGE, ExecRequest, Exited, Started
from kibotos.errors import DeadlineExceeded, KibotosError, Unavailable

if TYPE_CHECKING:  # ssl is imported for a wss:// data plane only
    import ssl

_READ = 64 * 1024
#: Close code for a message over MAX_MESSAGE (RFC 6455 "message too big").
_CLOSE_TOO_BIG = 1009
#: Close code of a connection that ended without a close frame.
_CLOSE_ABNORMAL = 1006


class BlockingExec:
    """One running exec; made by `connect`."""

    def __init__(self, sock: socket.socket, ws: WSConnection, url: str,
                 early: list[Event]) -> None:
        self._sock = sock
        self._ws = ws
        self.url = url
        self.pid: int | None = None
        self.exit: Exited | None = None
        #: What a non-blocking call raises when it would block (TLS has two more).
        self._would_block: tuple[type[OSError], ...] = (BlockingIOError,)
        self._tls = type(sock).__name__ == "SSLSocket"
        if self._tls:
            import ssl

            self._would_block += (ssl.SSLWantReadError, ssl.SSLWantWriteError)
        #: Set once the connection is over: the close code and reason, for messages.
        self.ended: tuple[int, str] | None = None
        self._out = bytearray()
        self._parts: list[bytes | bytearray | str] = []
        self._size = 0
        self._early = early

    def fileno(self) -> int:
        return self._sock.fileno()

    # ------------------------------------------------------------------ sending

    @property
    def backlog(self) -> int:
        """Bytes queued for the data plane and not yet written."""
        return len(self._out)

    @property
    def wants_write(self) -> bool:
        return bool(self._out)

    def send_stdin(self, data: bytes) -> None:
        for frame in exec_wire.stdin_frames(data):
            self._queue(BytesMessage(data=frame))

    def close_stdin(self) -> None:
        self._queue(TextMessage(data=exec_wire.eof_frame()))

    def resize(self, rows: int, cols: int) -> None:
        self._queue(TextMessage(data=exec_wire.resize_frame(rows, cols)))

    def signal(self, sig: str | int, *, group: bool = True) -> None:
        self._queue(TextMessage(data=exec_wire.signal_frame(sig, group)))

    def _queue(self, event: Event) -> None:
        if self.ended is not None or self._ws.state is not ConnectionState.OPEN:
            raise Unavailable("the data-plane connection is closed")
        self._out += self._ws.send(event)

    def flush(self) -> None:
        """Write what the socket takes now; a broken connection ends it (the reader
        then says so)."""
        while self._out:
            try:
                sent = self._sock.send(self._out)
            except self._would_block:
                return
            except OSError:
                self._out.clear()
                self._end(_CLOSE_ABNORMAL, "")
                return
            del self._out[:sent]

    # ------------------------------------------------------------------ receiving

    def receive(self) -> list[exec_wire.Event]:
        """The events of what the socket holds now (it must be readable, or the call
        returns nothing); raises the data plane's ``error`` frame as its error."""
        events = [e for e in (self._on(event) for event in self._early) if e is not None]
        self._early = []
        while self.ended is None:
            try:
                data = self._sock.recv(_READ)
            except self._would_block:
                break
            except OSError:
                self._end(_CLOSE_ABNORMAL, "")
                break
            try:
                self._ws.receive_data(data or None)
                for event in self._ws.events():
                    decoded = self._on(event)
                    if decoded is not None:
                        events.append(decoded)
            except RemoteProtocolError as exc:
                self._end(_CLOSE_ABNORMAL, f"protocol error: {exc}")
            if not data:
                self._end(_CLOSE_ABNORMAL, "")
            tls_pending = self._tls and self._sock.pending()  # type: ignore[attr-defined]
            if len(data) < _READ and not tls_pending:
                break
        return events

    def _on(self, event: Event) -> exec_wire.Event | None:
        if isinstance(event, TextMessage | BytesMessage):
            self._size += len(event.data)
            if self._size > MAX_MESSAGE:
                self._out += self._ws.send(CloseConnection(_CLOSE_TOO_BIG, "message too big"))
                self.flush()
                self._end(_CLOSE_TOO_BIG, "message too big")
                return None
            self._parts.append(event.data)
            if not event.message_finished:
                return None
            parts, self._parts, self._size = self._parts, [], 0
            message: bytes | str = (b"".join(p for p in parts if not isinstance(p, str))
                                    if isinstance(event, BytesMessage)
                                    else "".join(p for p in parts if isinstance(p, str)))
            decoded = exec_wire.decode(message)
            if isinstance(decoded, Started):
                self.pid = decoded.pid or None
            elif isinstance(decoded, Exited):
                self.exit = decoded
            return decoded
        if isinstance(event, Ping):
            self._out += self._ws.send(event.response())
        elif isinstance(event, CloseConnection):
            if self._ws.state is ConnectionState.REMOTE_CLOSING:
                self._out += self._ws.send(event.response())
                self.flush()
            self._end(event.code, event.reason or "")
        return None

    def _end(self, code: int, reason: str) -> None:
        if self.ended is None:
            self.ended = (code, reason)

    def check_open(self) -> None:
        """Raise `Unavailable` if the connection ended before the process's exit."""
        if self.ended is not None and self.exit is None:
            code, reason = self.ended
            detail = f" ({code} {reason}".rstrip() + ")"
            raise Unavailable("the data-plane connection closed before the process "
                              "exited" + detail)

    # ------------------------------------------------------------------ closing

    def close(self, timeout: float = 2.0) -> None:
        """Close the WebSocket (waiting up to `timeout` for the data plane's answer)
        and the socket, whatever state they are in."""
        try:
            if self.ended is None and self._ws.state is ConnectionState.OPEN:
                self._out += self._ws.send(CloseConnection(1000))
            self._sock.setblocking(True)
            self._sock.settimeout(timeout)
            deadline = time.monotonic() + timeout
            if self._out:
                self._sock.sendall(self._out)
                self._out.clear()
            while self.ended is None and time.monotonic() < deadline:
                self._sock.settimeout(max(0.01, deadline - time.monotonic()))
                data = self._sock.recv(_READ)
                self._ws.receive_data(data or None)
                for event in self._ws.events():
                    if isinstance(event, CloseConnection):
                        self._end(event.code, event.reason or "")
                if not data:
                    break
        except (OSError, RemoteProtocolError, KibotosError):
            pass
        finally:
            self._sock.close()


@contextmanager
def _connect_errors(url: str, timeout: float, what: str) -> Iterator[None]:
    try:
        yield
    except TimeoutError:
        raise DeadlineExceeded(f"the data plane at {url} did not {what} within "
                               f"{timeout:g}s") from None
    except RemoteProtocolError as exc:
        raise Unavailable(f"WebSocket handshake with {url} failed: {exc}") from None
    except OSError as exc:
        raise Unavailable(f"cannot reach the data plane at {url}: {exc}") from None


def connect(dataplane_url: str, credential: str | None, request: ExecRequest, *,
            connect_timeout: float = 30.0,
            ssl_context: ssl.SSLContext | None = None) -> BlockingExec:
    """Connect, authenticate and send the request: the process is starting when this
    returns.  (`credential` None sends no Authorization header: the data plane answers
    401.)  A refused upgrade is the error the data plane's JSON body names."""
    url = exec_wire.exec_url(dataplane_url)
    target = urllib.parse.urlsplit(url)
    host = target.hostname or ""
    tls = target.scheme == "wss"
    port = target.port or (443 if tls else 80)
    deadline = time.monotonic() + connect_timeout
    with _connect_errors(url, connect_timeout, "accept a connection"):
        sock = socket.create_connection((host, port), timeout=connect_timeout)
    try:
        with _connect_errors(url, connect_timeout, "accept a connection"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls:
                import ssl

                sock = (ssl_context or ssl.create_default_context()).wrap_socket(
                    sock, server_hostname=host)
        ws = WSConnection(ConnectionType.CLIENT)
        headers = [] if credential is None else [
            (b"Authorization", f"Bearer {credential}".encode())]
        with _connect_errors(url, connect_timeout, "answer the upgrade"):
            sock.sendall(ws.send(Request(host=target.netloc, target=target.path,
                                         extra_headers=headers)))
            early = _handshake(sock, ws, url, deadline)
            client = BlockingExec(sock, ws, url, early)
            sock.sendall(ws.send(TextMessage(data=exec_wire.request_frame(request))))
        sock.setblocking(False)
        return client
    except BaseException:
        sock.close()
        raise


def _handshake(sock: socket.socket, ws: WSConnection, url: str,
               deadline: float) -> list[Event]:
    """Read until the upgrade is accepted; returns the events that came after it in
    the same reads.  A rejection raises the error it stands for."""
    status: int | None = None
    body = bytearray()
    while True:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        data = sock.recv(_READ)
        ws.receive_data(data or None)
        events = list(ws.events())
        for i, event in enumerate(events):
            if isinstance(event, AcceptConnection):
                return events[i + 1:]
            if isinstance(event, RejectConnection):
                status = event.status_code
                if not event.has_body:
                    raise exec_wire.rejection(status, b"", url)
            elif isinstance(event, RejectData):
                body += event.data
                if event.body_finished and status is not None:
                    raise exec_wire.rejection(status, bytes(body), url)
        if not data:
            raise Unavailable(f"WebSocket handshake with {url} failed: the connection "
                              "closed before the upgrade was answered")
