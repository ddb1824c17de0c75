"""The client end of exec for ``kibo workspace exec``: a socket, no trio.

`kibotos.dataplane.clients.client` is the same client on trio and trio-websocket; importing
those two costs about 0.15 s of CPU, more than the rest of a ``kibo`` command, so the
CLI speaks the protocol from one thread over a plain socket instead:
`kibotos.dataplane.clients.ws_client` does the WebSocket protocol,
`kibotos.dataplane.clients.exec_wire` says what each message means, for both exec clients alike.

`connect` blocks until the upgrade is accepted and the request frame is sent; then the
socket is non-blocking and the caller runs the loop (`kibotos.cli.workspace.exec_relay`): it
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

from kibotos.core.errors import DeadlineExceeded, KibotosError, Unavailable
from kibotos.dataplane.clients import exec_wire, ws_client
from kibotos.dataplane.clients.exec_wire import MAX_MESSAGE, ExecRequest, Exited, Started
from kibotos.dataplane.clients.ws_client import (
    Accepted,
    Closed,
    HandshakeError,
    Message,
    Rejected,
    WsClient,
)

if TYPE_CHECKING:  # ssl is imported for a wss:// data plane only
    import ssl

_READ = 64 * 1024
#: Close code of a connection that ended without a close frame.
_CLOSE_ABNORMAL = 1006


class BlockingExec:
    """One running exec; made by `connect`."""

    def __init__(self, sock: socket.socket, ws: WsClient, url: str) -> None:
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
        #: Events already read (with the upgrade's answer) that `receive` hands out.
        self._pending: list[exec_wire.Event] = []

    @property
    def has_pending(self) -> bool:
        """Whether `receive` has events even if the socket is not readable."""
        return bool(self._pending)

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
        self._check_sendable()
        for frame in exec_wire.stdin_frames(data):
            self._ws.send_bytes(frame)
        self._take()

    def close_stdin(self) -> None:
        self._send_text(exec_wire.eof_frame())

    def resize(self, rows: int, cols: int) -> None:
        self._send_text(exec_wire.resize_frame(rows, cols))

    def signal(self, sig: str | int, *, group: bool = True) -> None:
        self._send_text(exec_wire.signal_frame(sig, group))

    def _send_text(self, text: str) -> None:
        self._check_sendable()
        self._ws.send_text(text)
        self._take()

    def _check_sendable(self) -> None:
        if self.ended is not None or not self._ws.open:
            raise Unavailable("the data-plane connection is closed")

    def _take(self) -> None:
        self._out += self._ws.data_to_send()

    def flush(self) -> None:
        """Write what the socket takes now; a broken connection ends it (the reader
        then says so)."""
        self._take()
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
        events, self._pending = self._pending, []
        while self.ended is None:
            try:
                data = self._sock.recv(_READ)
            except self._would_block:
                break
            except OSError:
                self._end(_CLOSE_ABNORMAL, "")
                break
            self._ws.receive_data(data)
            events += self._decode(self._ws.events())
            tls_pending = self._tls and self._sock.pending()  # type: ignore[attr-defined]
            if len(data) < _READ and not tls_pending:
                break
        self.flush()  # pongs and the answer to a close
        return events

    def _decode(self, found: list[ws_client.Event]) -> list[exec_wire.Event]:
        events = []
        for event in found:
            if isinstance(event, Closed):
                self._end(event.code, event.reason)
            elif isinstance(event, Message):
                decoded = exec_wire.decode(event.data)
                if isinstance(decoded, Started):
                    self.pid = decoded.pid or None
                elif isinstance(decoded, Exited):
                    self.exit = decoded
                if decoded is not None:
                    events.append(decoded)
        return events

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
            if self.ended is None:
                self._ws.close()
            self._take()
            self._sock.setblocking(True)
            self._sock.settimeout(timeout)
            deadline = time.monotonic() + timeout
            if self._out:
                self._sock.sendall(self._out)
                self._out.clear()
            while self.ended is None and time.monotonic() < deadline:
                self._sock.settimeout(max(0.01, deadline - time.monotonic()))
                data = self._sock.recv(_READ)
                self._ws.receive_data(data)
                for event in self._ws.events():
                    if isinstance(event, Closed):
                        self._end(event.code, event.reason)
        except (OSError, KibotosError):
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
    except HandshakeError as exc:
        raise Unavailable(f"WebSocket handshake with {url} failed: {exc}") from None
    except OSError as exc:
        if url.startswith("wss:"):  # (imported on this error only: kibo starts fast)
            from kibotos.dataplane.clients.tls_client import unverified
            from kibotos.tls.contexts import verification_error

            failed = verification_error(exc)
            if failed is not None:  # retrying cannot fix it
                raise unverified(url, failed.verify_message or str(failed)) from None
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
        headers = [] if credential is None else [("Authorization", f"Bearer {credential}")]
        ws = WsClient(target.netloc, target.path, headers, max_message=MAX_MESSAGE)
        with _connect_errors(url, connect_timeout, "answer the upgrade"):
            sock.sendall(ws.request())
            client = BlockingExec(sock, ws, url)
            early = _handshake(sock, ws, url, deadline)
            ws.send_text(exec_wire.request_frame(request))
            sock.sendall(ws.data_to_send())
        sock.setblocking(False)
        client._pending = client._decode(early)
        return client
    except BaseException:
        sock.close()
        raise


def _handshake(sock: socket.socket, ws: WsClient, url: str,
               deadline: float) -> list[ws_client.Event]:
    """Read until the upgrade is accepted; returns the events that came after it in
    the same reads.  A rejection raises the error it stands for."""
    while True:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        data = sock.recv(_READ)
        ws.receive_data(data)
        events = ws.events()
        for i, event in enumerate(events):
            if isinstance(event, Accepted):
                return list(events[i + 1:])
            if isinstance(event, Rejected):
                raise exec_wire.rejection(event.status_code, event.body, url)
        if not data:
            raise HandshakeError("the connection closed before the upgrade was answered")
