"""The client side of the WebSocket protocol (RFC 6455), without I/O, for ``kibo``.

`kibotos.dataplane.clients.exec_blocking` speaks to the data plane through this.  wsproto does
the same job (and runs under trio-websocket on the server), but builds a 64 Ki-entry
masking table when it is imported: a tenth of ``kibo workspace exec``'s CPU.  A client
needs far less than wsproto offers, so this is only that: the upgrade (HTTP/1.1 by h11,
the accept key checked), data and control frames in, masked frames out, fragments
joined, ping answered, close answered, and every protocol violation ending the
connection with the RFC's close code.  No extensions or subprotocols are offered, so
none may come back.  tests/dataplane/test_ws_client.py runs it against wsproto's server
side, frame by frame.

Use: send `request()`; feed what the socket reads to `receive_data` (``b""`` at its
end) and take `events()`; `send_text`, `send_bytes` and `close` queue frames; write
`data_to_send()` to the socket.
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass

import h11

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_CONTINUATION, _TEXT, _BINARY, _CLOSE, _PING, _PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
class _Consumed:
    """What `WsClient._next_frame` returns for a frame that is no event of its own."""


_CONSUMED = _Consumed()
#: Close codes (RFC 6455 7.4.1).
NORMAL, PROTOCOL_ERROR, INVALID_DATA, TOO_BIG, ABNORMAL = 1000, 1002, 1007, 1009, 1006


@dataclass(frozen=True)
class Accepted:
    """The upgrade was accepted: frames follow."""


@dataclass(frozen=True)
class Rejected:
    """The server answered the upgrade with an HTTP response instead (whole body)."""

    status_code: int
    body: bytes


@dataclass(frozen=True)
class Message:
    data: bytes | str  # bytes for a binary message, str for a text one


@dataclass(frozen=True)
class Closed:
    """The connection is over: the peer's close frame, or what ended it (1006 when
    the stream ended without one, 1002/1007/1009 for a violation found here)."""

    code: int
    reason: str


Event = Accepted | Rejected | Message | Closed


class HandshakeError(Exception):
    """The server's answer to the upgrade was not a valid WebSocket acceptance."""


class WsClient:
    """One client connection's protocol state; see the module docstring."""

    def __init__(self, host: str, target: str,
                 headers: list[tuple[str, str]] | None = None, *,
                 max_message: int = 1 << 20) -> None:
        self._key = base64.b64encode(os.urandom(16))
        self._http: h11.Connection | None = h11.Connection(h11.CLIENT)
        self._request = self._http.send(h11.Request(
            method="GET", target=target, headers=[
                ("Host", host), ("Upgrade", "websocket"), ("Connection", "Upgrade"),
                ("Sec-WebSocket-Key", self._key.decode()), ("Sec-WebSocket-Version", "13"),
                *(headers or [])])) + self._http.send(h11.EndOfMessage())
        self._status: int | None = None
        self._body = bytearray()
        self.max_message = max_message
        self.open = False  # frames may be sent
        self.closed: Closed | None = None
        self._close_sent = False
        self._in = bytearray()
        self._out = bytearray()
        self._parts: list[bytes] = []
        self._opcode: int | None = None  # of the fragmented message being received
        self._size = 0
        self._eof = False

    def request(self) -> bytes:
        """The upgrade request, to be sent first."""
        return self._request

    # ------------------------------------------------------------------ sending

    def data_to_send(self) -> bytes:
        out, self._out = bytes(self._out), bytearray()
        return out

    def send_text(self, text: str) -> None:
        self._send(_TEXT, text.encode())

    def send_bytes(self, data: bytes) -> None:
        self._send(_BINARY, data)

    def close(self, code: int = NORMAL, reason: str = "") -> None:
        """Queue our close frame (once); the connection is over when the peer's
        answer arrives, or the socket ends."""
        if not self._close_sent and self.open:
            self._close_sent = True
            self._out += _frame(_CLOSE, code.to_bytes(2, "big") + reason.encode()[:123])
        self.open = False

    def _send(self, opcode: int, payload: bytes) -> None:
        if not self.open:
            raise ConnectionError("the WebSocket is not open")
        self._out += _frame(opcode, payload)

    # ------------------------------------------------------------------ receiving

    def receive_data(self, data: bytes) -> None:
        """What the socket read; ``b""`` when it reached its end."""
        if not data:
            self._eof = True
        if self._http is not None:
            self._http.receive_data(data)
        else:
            self._in += data

    def events(self) -> list[Event]:
        """Everything the data fed so far makes complete, in order."""
        found: list[Event] = []
        if self._http is not None:
            found += self._handshake()
        while self._http is None and self.closed is None:
            event = self._next_frame()
            if event is None:  # no whole frame left
                break
            if not isinstance(event, _Consumed):
                found.append(event)
        if self._http is None and self.closed is None and self._eof:
            found.append(self._end(Closed(ABNORMAL, "")))  # ended without a close frame
        return found

    def _handshake(self) -> list[Event]:
        assert self._http is not None
        while True:
            try:
                event = self._http.next_event()
            except h11.ProtocolError as exc:
                if self._eof and self._status is None:
                    raise HandshakeError("the connection closed before the upgrade was "
                                         "answered") from None
                raise HandshakeError(f"bad HTTP answer to the upgrade: {exc}") from None
            if event is h11.NEED_DATA:
                return []
            if isinstance(event, h11.InformationalResponse):
                if event.status_code != 101:
                    continue
                self._check_accept(dict(event.headers))
                leftover, _ = self._http.trailing_data
                self._http = None
                self._in += leftover
                self.open = True
                return [Accepted()]
            if isinstance(event, h11.Response):
                self._status = event.status_code
            elif isinstance(event, h11.Data):
                self._body += event.data
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                if self._status is None:
                    raise HandshakeError("the connection closed before the upgrade was "
                                         "answered")
                self.closed = Closed(ABNORMAL, f"rejected with HTTP {self._status}")
                self._http = None
                return [Rejected(self._status, bytes(self._body))]

    def _check_accept(self, headers: dict[bytes, bytes]) -> None:
        expected = base64.b64encode(hashlib.sha1(self._key + _GUID).digest())
        if headers.get(b"upgrade", b"").lower() != b"websocket":
            raise HandshakeError("the 101 answer does not upgrade to websocket")
        if b"upgrade" not in headers.get(b"connection", b"").lower():
            raise HandshakeError("the 101 answer has no Connection: Upgrade")
        if headers.get(b"sec-websocket-accept") != expected:
            raise HandshakeError("the 101 answer's Sec-WebSocket-Accept is wrong")
        for offered_none in (b"sec-websocket-extensions", b"sec-websocket-protocol"):
            if offered_none in headers:
                raise HandshakeError(f"the server chose {offered_none.decode()}, which "
                                     "was not offered")

    def _next_frame(self) -> Event | _Consumed | None:
        """The event of the next whole frame, `_CONSUMED` for a frame that makes none
        (a ping, a pong, a fragment), None when no whole frame is there yet."""
        buf = self._in
        if len(buf) < 2:
            return None
        first, second = buf[0], buf[1]
        fin, opcode, length = first & 0x80, first & 0x0F, second & 0x7F
        if first & 0x70:
            return self._violation(PROTOCOL_ERROR, "reserved bits set")
        if second & 0x80:
            return self._violation(PROTOCOL_ERROR, "the server masked a frame")
        at = 2
        if length == 126:
            if len(buf) < 4:
                return None
            length, at = int.from_bytes(buf[2:4], "big"), 4
        elif length == 127:
            if len(buf) < 10:
                return None
            length, at = int.from_bytes(buf[2:10], "big"), 10
        if opcode >= _CLOSE and (not fin or length > 125):
            return self._violation(PROTOCOL_ERROR, "a fragmented or long control frame")
        if opcode < _CLOSE and self._size + length > self.max_message:
            return self._violation(TOO_BIG, "message too big")
        if len(buf) < at + length:
            return None
        payload = bytes(buf[at:at + length])
        del buf[:at + length]
        if opcode == _PING:
            self._out += _frame(_PONG, payload)
            return _CONSUMED
        if opcode == _PONG:
            return _CONSUMED
        if opcode == _CLOSE:
            return self._on_close(payload)
        return self._on_data(opcode, bool(fin), payload)

    def _on_data(self, opcode: int, fin: bool, payload: bytes) -> Event | _Consumed:
        if opcode == _CONTINUATION:
            if self._opcode is None:
                return self._violation(PROTOCOL_ERROR, "a continuation of nothing")
        elif opcode in (_TEXT, _BINARY):
            if self._opcode is not None:
                return self._violation(PROTOCOL_ERROR, "a new message inside another")
            self._opcode = opcode
        else:
            return self._violation(PROTOCOL_ERROR, f"unknown opcode {opcode}")
        self._parts.append(payload)
        self._size += len(payload)
        if not fin:
            return _CONSUMED
        data, kind = b"".join(self._parts), self._opcode
        self._parts, self._opcode, self._size = [], None, 0
        if kind == _BINARY:
            return Message(data)
        try:
            return Message(data.decode("utf-8"))
        except UnicodeDecodeError:
            return self._violation(INVALID_DATA, "a text message that is not UTF-8")

    def _on_close(self, payload: bytes) -> Event:
        if len(payload) == 1:
            return self._violation(PROTOCOL_ERROR, "a close frame of one byte")
        code = int.from_bytes(payload[:2], "big") if payload else 1005
        try:
            reason = payload[2:].decode("utf-8")
        except UnicodeDecodeError:
            return self._violation(INVALID_DATA, "a close reason that is not UTF-8")
        if not self._close_sent:  # answer it, as the RFC asks
            self._close_sent = True
            echo = payload[:2] if payload else b""
            self._out += _frame(_CLOSE, echo)
        return self._end(Closed(code, reason))

    def _violation(self, code: int, why: str) -> Closed:
        if not self._close_sent:
            self._close_sent = True
            self._out += _frame(_CLOSE, code.to_bytes(2, "big") + why.encode()[:123])
        return self._end(Closed(code, why))

    def _end(self, closed: Closed) -> Closed:
        self.open = False
        self.closed = closed
        self._in.clear()
        return closed


def _frame(opcode: int, payload: bytes) -> bytes:
    """One final client frame: masked with a fresh key, as a client's must be."""
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, 0x80 | n))
    elif n < 1 << 16:
        head = bytes((0x80 | opcode, 0x80 | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + n.to_bytes(8, "big")
    mask = os.urandom(4)
    return head + mask + _masked(payload, mask)


def _masked(payload: bytes, mask: bytes) -> bytes:
    """XOR with the repeated mask, as one big-integer operation (fast in C)."""
    n = len(payload)
    if not n:
        return b""
    key = (mask * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "little") ^ int.from_bytes(key, "little")).to_bytes(
        n, "little")
