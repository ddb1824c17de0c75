"""`kibotos.dataplane.clients.ws_client` (kibo's own WebSocket client protocol) against wsproto's
server side, the implementation trio-websocket serves the data plane with: both are
sans-I/O, so every byte one writes is fed to the other, and each check is what the
other side made of it.  Frames wsproto cannot be made to send (masked, reserved bits,
bad UTF-8) are written by hand, per RFC 6455.
"""

from __future__ import annotations

import base64
import hashlib
import os

import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Pong,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)

from kibotos.dataplane.clients.ws_client import (
    Accepted,
    Closed,
    HandshakeError,
    Message,
    Rejected,
    WsClient,
)


def feed_server(client: WsClient, server: WSConnection) -> list[object]:
    server.receive_data(client.data_to_send())
    return list(server.events())


def feed_client(server_bytes: bytes, client: WsClient) -> list[object]:
    client.receive_data(server_bytes)
    return list(client.events())


def opened(max_message: int = 1 << 20) -> tuple[WsClient, WSConnection]:
    client = WsClient("dp.example:7500", "/v1/exec", [("Authorization", "Bearer x")],
                      max_message=max_message)
    server = WSConnection(ConnectionType.SERVER)
    server.receive_data(client.request())
    [request] = list(server.events())
    assert isinstance(request, Request)
    assert (request.host, request.target) == ("dp.example:7500", "/v1/exec")
    assert (b"authorization", b"Bearer x") in [(k.lower(), v) for k, v in
                                                request.extra_headers]
    assert feed_client(server.send(AcceptConnection()), client) == [Accepted()]
    assert client.open
    return client, server


def test_messages_both_ways_large_and_fragmented() -> None:
    client, server = opened(max_message=8 << 20)
    big = os.urandom(3 * 1024 * 1024 + 1)
    client.send_text('{"argv": ["cat"]}')
    client.send_bytes(b"\x00stdin")
    client.send_bytes(big)
    client.send_bytes(b"")
    got = feed_server(client, server)
    data = [e.data for e in got if isinstance(e, TextMessage | BytesMessage)]
    assert data == ['{"argv": ["cat"]}', b"\x00stdin", big, b""]
    out = (server.send(BytesMessage(data=b"\x01out")) + server.send(TextMessage(data="ünï"))
           + server.send(BytesMessage(data=big)))
    # A message in three fragments, with a ping between two of them.
    out += server.send(TextMessage(data="par", message_finished=False))
    out += server.send(Ping(payload=b"hello"))
    out += server.send(TextMessage(data="t", message_finished=False))
    out += server.send(TextMessage(data="s", message_finished=True))
    events = []
    for i in range(0, len(out), 1000):  # in small reads, as a socket may deliver it
        events += feed_client(out[i:i + 1000], client)
    assert events == [Message(b"\x01out"), Message("ünï"), Message(big), Message("parts")]
    assert [e for e in feed_server(client, server) if isinstance(e, Pong)] == [
        Pong(payload=b"hello")]


def test_closing_from_either_side() -> None:
    client, server = opened()
    events = feed_client(server.send(CloseConnection(code=1000, reason="process exited")),
                         client)
    assert events == [Closed(1000, "process exited")]
    assert not client.open
    with pytest.raises(ConnectionError):
        client.send_text("late")
    [echo] = feed_server(client, server)
    assert isinstance(echo, CloseConnection)
    assert echo.code == 1000

    client, server = opened()
    client.close(1000)
    [close] = feed_server(client, server)
    assert isinstance(close, CloseConnection)
    assert close.code == 1000
    assert feed_client(server.send(close.response()), client) == [Closed(1000, "")]


def test_the_end_of_the_stream_without_a_close_is_1006() -> None:
    client, _ = opened()
    assert feed_client(b"", client) == [Closed(1006, "")]


def test_a_rejection_with_its_body() -> None:
    client = WsClient("dp", "/v1/exec")
    server = WSConnection(ConnectionType.SERVER)
    server.receive_data(client.request())
    list(server.events())
    body = b'{"error": {"code": "unauthenticated", "message": "no credential"}}'
    answer = server.send(RejectConnection(status_code=401, has_body=True, headers=[
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode())]))
    answer += server.send(RejectData(data=body))
    assert feed_client(answer, client) == [Rejected(401, body)]
    assert not client.open


def _accept_with(client: WsClient, accept: bytes, extra: bytes = b"") -> None:
    answer = (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
              b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n" + extra
              + b"\r\n")
    client.receive_data(answer)
    client.events()


def _key(client: WsClient) -> bytes:
    line = next(li for li in client.request().split(b"\r\n")
                if li.lower().startswith(b"sec-websocket-key:"))
    return line.split(b":", 1)[1].strip()


def _accept(key: bytes) -> bytes:
    guid = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
    return base64.b64encode(hashlib.sha1(key + guid).digest())


def test_a_bad_acceptance_is_a_handshake_error() -> None:
    with pytest.raises(HandshakeError, match="Sec-WebSocket-Accept"):
        _accept_with(WsClient("dp", "/"), b"bm90IHRoZSBrZXk=")
    client = WsClient("dp", "/")
    with pytest.raises(HandshakeError, match="not offered"):
        _accept_with(client, _accept(_key(client)), b"Sec-WebSocket-Extensions: x\r\n")
    client = WsClient("dp", "/")
    client.receive_data(b"")
    with pytest.raises(HandshakeError, match="closed before"):
        client.events()


def _raw(first: int, payload: bytes, *, masked: bool = False) -> bytes:
    head = bytes((first, (0x80 if masked else 0) | len(payload)))
    return head + (b"\0\0\0\0" if masked else b"") + payload


@pytest.mark.parametrize(("frame", "code"), [
    (_raw(0x81, b"hi", masked=True), 1002),     # servers must not mask
    (_raw(0xC1, b"hi"), 1002),                  # a reserved bit (no extension offered)
    (_raw(0x83, b"hi"), 1002),                  # an unknown opcode
    (_raw(0x09, b"ping"), 1002),                # a fragmented control frame
    (_raw(0x80, b"cont"), 1002),                # a continuation of nothing
    (_raw(0x81, b"\xff\xfe"), 1007),            # a text message that is not UTF-8
    (_raw(0x82, b"x" * 100), 1009),             # over the client's max_message
])
def test_violations_close_with_the_rfc_code(frame: bytes, code: int) -> None:
    client, server = opened(max_message=64)
    [closed] = feed_client(frame, client)
    assert isinstance(closed, Closed)
    assert closed.code == code
    [close] = [e for e in feed_server(client, server) if isinstance(e, CloseConnection)]
    assert close.code == code  # the server is told why
    assert feed_client(_raw(0x81, b"after"), client) == []  # nothing after the end
