"""Request bodies a hostile caller sends ctrl (issue 16, "Bodies"), against hypercorn on
127.0.0.1:0 (``running_ctrl``), written by hand on a raw TCP stream where httpx would
not send what a hostile client sends (a Content-Length it never honours, a chunked body
that does not end).

A body over the route's limit is refused with 413 before ctrl reads it (the test sends
a few bytes of a declared 200 MB and gets the answer); a streamed body is refused as
soon as it passes the limit (the test never ends its chunked body); every way a JSON
text can be wrong is ``invalid_argument``, the nesting too deep and a duplicate key
included, and the response names no Python exception.
"""

from __future__ import annotations

import contextlib
import json
from urllib.parse import urlsplit

import pytest
import trio
from ctrl_helpers import RunningCtrl, error, public_key

from kibotos.ctrl.api.enrollment import EXCHANGE_BODY_LIMIT

EXCHANGE = "/v1/enrollment/exchange"


async def raw_exchange(ctrl: RunningCtrl, head: str, body_parts: list[bytes]) -> bytes:
    """Send `head` (request line and headers) and `body_parts` to ctrl, then read what
    it answers until it closes or the head and a body of the announced length came."""
    url = urlsplit(ctrl.url)
    assert url.hostname is not None
    assert url.port is not None
    stream: trio.abc.Stream = await trio.open_tcp_stream(url.hostname, url.port)
    if url.scheme == "https":
        # ctrl serves TLS from its cluster CA: the raw bytes go inside a verified session.
        assert ctrl.tls is not None
        stream = trio.SSLStream(stream, ctrl.tls, server_hostname=url.hostname)
        await stream.do_handshake()
    async with stream:
        # One write (ctrl may answer and close before a later one); if ctrl closed
        # first, its answer is still there to be read.
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(head.encode() + b"\r\n" + b"".join(body_parts))
        answer = b""
        with trio.fail_after(30):
            while True:
                try:
                    data = await stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
                if not data:
                    break
                answer += data
                head_end = answer.find(b"\r\n\r\n")
                if head_end >= 0:
                    length = _content_length(answer[:head_end])
                    if len(answer) >= head_end + 4 + length:
                        break
    return answer


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


def status_and_body(answer: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, dict(json.loads(body))


def head(host: str, **headers: str) -> str:
    lines = [f"POST {EXCHANGE} HTTP/1.1", f"Host: {host}",
             "Content-Type: application/json"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return "\r\n".join(lines) + "\r\n"


async def test_a_declared_length_over_the_limit_is_refused_before_the_body(
        running_ctrl: RunningCtrl) -> None:
    host = urlsplit(running_ctrl.url).netloc
    answer = await raw_exchange(running_ctrl, head(host, Content_Length="200000000"),
                                [b"{" + b" " * 1000])
    status, body = status_and_body(answer)
    assert status == 413, answer[:300]
    assert body["error"]["code"] == "invalid_argument"  # type: ignore[index]
    assert str(EXCHANGE_BODY_LIMIT) in body["error"]["message"]  # type: ignore[index]


async def test_a_chunked_body_is_stopped_at_the_limit(running_ctrl: RunningCtrl) -> None:
    """The chunked body never ends: only a ctrl that counts the bytes as they come and
    stops at the limit answers at all."""
    host = urlsplit(running_ctrl.url).netloc
    chunk = b"a" * 4096
    parts = [f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"] * (
        EXCHANGE_BODY_LIMIT // len(chunk) + 2)
    answer = await raw_exchange(running_ctrl, head(host, Transfer_Encoding="chunked"), parts)
    status, body = status_and_body(answer)
    assert status == 413, answer[:300]
    assert body["error"]["code"] == "invalid_argument"  # type: ignore[index]


async def test_a_body_over_the_default_limit_is_refused(running_ctrl: RunningCtrl) -> None:
    """Routes without a limit of their own take 1 MiB: an operator's 2 MiB grant
    request is refused on its Content-Length, as the exchange's over 8 KiB is."""
    host = urlsplit(running_ctrl.url).netloc
    lines = ["POST /v1/enrollment/grants HTTP/1.1", f"Host: {host}",
             "Content-Type: application/json", f"Content-Length: {2 << 20}",
             f"Authorization: {running_ctrl.operator['Authorization']}"]
    answer = await raw_exchange(running_ctrl, "\r\n".join(lines) + "\r\n",
                                [b"{" + b" " * 4096])
    status, body = status_and_body(answer)
    assert status == 413, answer[:300]
    assert body["error"]["code"] == "invalid_argument"  # type: ignore[index]


def _deep_array(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _deep_object(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


BAD_JSON = [
    pytest.param(_deep_array(1000), "nested deeper", id="array-1000-deep"),
    pytest.param(_deep_array(100_000), "nested deeper", id="array-100000-deep"),
    pytest.param(b'{"token": ' + _deep_object(40) + b"}", "nested deeper",
                 id="object-40-deep"),
    pytest.param(b'{"token": "a", "token": "b", "public_key": "k"}', "duplicate key",
                 id="duplicate-key"),
    pytest.param(b'{"token": NaN, "public_key": "k"}', "not a JSON number", id="nan"),
    pytest.param(b'{"token": "\xff\xfe", "public_key": "k"}', "not UTF-8", id="not-utf8"),
    pytest.param(b'{"token": "a", ', "not valid JSON", id="truncated"),
    pytest.param(b"[]", "must be a JSON object", id="array"),
]


@pytest.mark.parametrize(("raw", "words"), BAD_JSON)
async def test_every_bad_json_text_is_invalid_argument(running_ctrl: RunningCtrl,
                                                       raw: bytes, words: str) -> None:
    resp = await running_ctrl.http.post(EXCHANGE, content=raw,
                                        headers={"Content-Type": "application/json"})
    if len(raw) > EXCHANGE_BODY_LIMIT:
        assert resp.status_code == 413
        return
    err = error(resp, "invalid_argument")
    assert words in err["message"]
    assert "Error" not in err["message"]  # no exception class, no traceback


async def test_a_good_exchange_body_still_passes_the_limits(running_ctrl: RunningCtrl) -> None:
    """The limits refuse nothing real: a well-formed exchange with an unknown token is
    judged on its token (permission_denied or not_found), not on its size or shape."""
    resp = await running_ctrl.http.post(
        EXCHANGE, json={"token": "kgr-nothing.secret", "public_key": public_key()})
    assert resp.status_code in (401, 403, 404), resp.text
