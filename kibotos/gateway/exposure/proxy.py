"""One client connection of the Exposure gateway: HTTP/1.1 requests, one after another
(keep-alive), each relayed to the sandbox port its host name or headers name.

* Bodies stream both ways as they come, under back-pressure: a chunk is read from one
  side only once the other took the previous one, so a connection holds at most a
  chunk (`CHUNK`) per direction, whatever the body's size.  The request body and the
  response run at once, so a sandbox may answer before it read the whole upload.
* An upgrade (a WebSocket) is passed to the sandbox; once it answers 101, the
  connection is a byte pipe both ways (half-closes passed on) until both ends close.
* Hop-by-hop headers (RFC 9110 7.6.1) are not passed on; the traffic token and the
  routing headers neither (the sandbox does not need them).  ``X-Forwarded-For`` gets
  the client's address, ``X-Forwarded-Host`` the host name it asked for.
* A refusal is a short ``text/plain`` answer, and the connection is closed after it:
  404 no such sandbox, 403 a private sandbox without its token, 400 a malformed
  request, 502 nothing listening on the port or the sandbox not running, 503 the
  gateway cannot ask ctrl.
"""

from __future__ import annotations

import logging
import time

import h11
import trio

from kibotos.core.errors import (
    InvalidArgument,
    KibotosError,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from kibotos.gateway.common.sandbox_labels import TRAFFIC_HEADER
from kibotos.gateway.exposure.access import SandboxAccess
from kibotos.gateway.exposure.config import Limits
from kibotos.gateway.exposure.metrics import ExposureMetrics
from kibotos.gateway.exposure.routing import SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER, target_of
from kibotos.gateway.exposure.upstream import CHUNK, MAX_HEAD, Upstream, open_upstream

log = logging.getLogger("kibotos.gateway.exposure")

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te",
                        b"trailer", b"upgrade", b"proxy-authenticate",
                        b"proxy-authorization"})
_NOT_FORWARDED = frozenset({TRAFFIC_HEADER.encode(), SANDBOX_ID_HEADER,
                            SANDBOX_PORT_HEADER})
Stream = trio.abc.Stream
#: `_download`'s status when the sandbox closed the stream before its answer began.
NO_ANSWER = -1


def _status_of(exc: KibotosError) -> int:
    if isinstance(exc, NotFound | PermissionDenied | InvalidArgument):
        return exc.http_status
    if exc.http_status in (502, 504) or isinstance(exc, Unavailable):
        return 502 if exc.http_status != 504 else 504
    return 503


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((value for key, value in headers if key == name), None)


def _wants_upgrade(request: h11.Request) -> bool:
    connection = _header(list(request.headers), b"connection") or b""
    return b"upgrade" in [t.strip().lower() for t in connection.split(b",")] and \
        _header(list(request.headers), b"upgrade") is not None


def _forwardable(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Without hop-by-hop headers and those the Connection header names."""
    named = {t.strip().lower() for t in (_header(headers, b"connection") or b"").split(b",")}
    return [(k, v) for k, v in headers if k not in HOP_BY_HOP and k not in named]


class ClientConnection:
    def __init__(self, stream: Stream, peer: str, access: SandboxAccess,
                 metrics: ExposureMetrics, limits: Limits, domain: str | None) -> None:
        self.stream = stream
        self.peer = peer
        self.access = access
        self.metrics = metrics
        self.limits = limits
        self.domain = domain
        self.http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.upstream: Upstream | None = None

    # ------------------------------------------------------------ the connection

    async def run(self) -> None:
        """Serve requests until the client or a failure ends the connection."""
        try:
            while True:
                request = await self._read_head()
                if not isinstance(request, h11.Request) or not await self._exchange(request):
                    return
                if self.http.our_state is not h11.DONE or self.http.their_state is not h11.DONE:
                    return
                self.http.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            await self._refuse(exc.error_status_hint, f"malformed request: {exc}")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            await self._drop_upstream()

    async def _receive(self) -> None:
        self.http.receive_data(bytes(await self.stream.receive_some(CHUNK)))

    async def _read_head(self) -> h11.Event | None:
        """The next request's head: None when the client stays idle too long or takes
        too long to send it once it began."""
        with trio.move_on_after(self.limits.idle_timeout_s) as scope:
            event = self.http.next_event()
            while event is h11.NEED_DATA:
                await self._receive()
                if scope.deadline > trio.current_time() + self.limits.header_timeout_s:
                    scope.deadline = trio.current_time() + self.limits.header_timeout_s
                event = self.http.next_event()
            return event  # type: ignore[return-value]
        return None

    async def _client_event(self) -> h11.Event:
        while True:
            event = self.http.next_event()
            if event is not h11.NEED_DATA and event is not h11.PAUSED:
                return event  # type: ignore[return-value]
            await self._receive()

    async def _send(self, event: h11.Event) -> None:
        data = self.http.send(event)
        if data:
            await self.stream.send_all(data)

    async def _refuse(self, status: int, message: str) -> int:
        """A short answer, the connection closed after it (when one can still be sent)."""
        if self.http.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return status
        body = (message + "\n").encode()
        try:
            await self._send(h11.Response(status_code=status, headers=[
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()), (b"connection", b"close")]))
            await self._send(h11.Data(data=body))
            await self._send(h11.EndOfMessage())
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
            pass
        return status

    # ------------------------------------------------------------ one exchange

    async def _exchange(self, request: h11.Request) -> bool:
        """Relay one request and its answer; whether the connection may serve another."""
        started, kind = time.perf_counter(), "http"
        try:
            status, keep = await self._answered(await self._relay(request))
        except KibotosError as exc:
            status, keep = await self._refuse(_status_of(exc), exc.message), False
        if status == 101:
            kind = "websocket"
        self.metrics.requests.labels(str(status), kind).inc()
        self.metrics.latency.observe(time.perf_counter() - started)
        if status == 101:
            await self._pipe()
            return False
        return keep

    async def _upstream_for(self, request: h11.Request) -> Upstream:
        headers = list(request.headers)
        target = target_of(headers, self.domain)
        if self.upstream is not None and (self.upstream.target != target
                                          or not self.upstream.reusable):
            await self._drop_upstream()
        if self.upstream is not None:
            self.upstream.http.start_next_cycle()
            # Access is asked again for every request: a token or a stop counts at once.
            await self.access.open(target, _text(_header(headers, TRAFFIC_HEADER.encode())))
            return self.upstream
        token = _text(_header(headers, TRAFFIC_HEADER.encode()))
        self.upstream = await open_upstream(self.access, target, token, self.metrics)
        return self.upstream

    async def _relay(self, request: h11.Request) -> tuple[int, bool]:
        upstream = await self._upstream_for(request)
        headers = list(request.headers)
        upgrade = _wants_upgrade(request)
        forwarded = [(k, v) for k, v in _forwardable(headers) if k not in _NOT_FORWARDED
                     and k not in (b"x-forwarded-for", b"x-forwarded-host")]
        previous = _header(headers, b"x-forwarded-for")
        forwarded.append((b"x-forwarded-for", (previous + b", " if previous else b"")
                          + self.peer.encode()))
        forwarded.append((b"x-forwarded-host", _header(headers, b"x-forwarded-host")
                          or _header(headers, b"host") or b""))
        if _header(headers, b"host") is None:  # an HTTP/1.0 client may send none
            forwarded.append((b"host", f"127.0.0.1:{upstream.target.port}".encode()))
        if upgrade:
            forwarded += [(b"connection", b"upgrade"),
                          (b"upgrade", _header(headers, b"upgrade") or b"")]
        await upstream.send(h11.Request(method=request.method, target=request.target,
                                        headers=forwarded))
        if upgrade:  # the 101 may come only after the whole request went
            if not await self._upload(upstream):
                return NO_ANSWER, False
            return await self._download(upstream, request)
        outcome: dict[str, bool] = {}
        answer: tuple[int, bool] = (502, False)

        async def upload(cancel: trio.CancelScope) -> None:
            outcome["uploaded"] = await self._upload(upstream)
            if not outcome["uploaded"]:
                cancel.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(upload, nursery.cancel_scope)
            answer = await self._download(upstream, request)
            if not outcome.get("uploaded"):
                nursery.cancel_scope.cancel()  # the sandbox answered before the upload ended
                answer = (answer[0], False)
        return answer

    async def _answered(self, answer: tuple[int, bool]) -> tuple[int, bool]:
        """`answer`, or a 502 to the client when the sandbox sent none (the stream is
        dropped here, outside the relay's tasks, where it was opened)."""
        if answer[0] != NO_ANSWER:
            return answer
        target = self.upstream.target if self.upstream else None
        await self._drop_upstream()
        where = f"port {target.port} in sandbox {target.sandbox_id}" if target else "the sandbox"
        return await self._refuse(502, f"the server on {where} closed the connection "
                                  "without an answer"), False

    async def _upload(self, upstream: Upstream) -> bool:
        """The request body to the sandbox; False when either side broke."""
        try:
            while True:
                event = await self._client_event()
                if isinstance(event, h11.Data):
                    await upstream.send(h11.Data(data=event.data))
                elif isinstance(event, h11.EndOfMessage):
                    await upstream.send(h11.EndOfMessage())
                    return True
                else:
                    return False
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return False

    async def _download(self, upstream: Upstream, request: h11.Request) -> tuple[int, bool]:
        """The sandbox's answer to the client: (status, keep the connection)."""
        status: int | None = None
        try:
            while True:
                event = await upstream.next_event()
                if isinstance(event, h11.InformationalResponse):
                    headers = list(event.headers) if event.status_code == 101 \
                        else _forwardable(list(event.headers))
                    await self._send(h11.InformationalResponse(
                        status_code=event.status_code, headers=headers, reason=event.reason))
                    if event.status_code == 101:
                        return 101, False
                elif isinstance(event, h11.Response):
                    status = event.status_code
                    await self._send(h11.Response(status_code=status, reason=event.reason,
                                                  headers=_forwardable(list(event.headers))))
                elif isinstance(event, h11.Data):
                    await self._send(h11.Data(data=event.data))
                elif isinstance(event, h11.EndOfMessage):
                    await self._send(h11.EndOfMessage())
                    return status or 502, True
                else:
                    break
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
            log.info("sandbox %s port %s: the exchange broke: %s",
                     upstream.target.sandbox_id, upstream.target.port, exc)
        return status or NO_ANSWER, False

    # ------------------------------------------------------------ after a 101

    async def _pipe(self) -> None:
        """Bytes both ways until both sides are done, half-closes passed on."""
        upstream = self.upstream
        assert upstream is not None
        client_rest, _ = self.http.trailing_data
        guest_rest, _ = upstream.http.trailing_data

        async def client_to_guest() -> None:
            if client_rest:
                await upstream.send_raw(client_rest)
            while data := await self.stream.receive_some(CHUNK):
                await upstream.send_raw(bytes(data))
            await upstream.stream.send_eof()

        async def guest_to_client() -> None:
            if guest_rest:
                await self.stream.send_all(guest_rest)
            while data := await upstream.receive_raw():
                await self.stream.send_all(data)
            if isinstance(self.stream, trio.abc.HalfCloseableStream):
                await self.stream.send_eof()  # TLS has no half-close: the pipe ends here
            else:
                raise trio.ClosedResourceError("the sandbox closed its side")

        async def guarded(pump: object, cancel: trio.CancelScope) -> None:
            try:
                await pump()  # type: ignore[operator]
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                cancel.cancel()  # one side broke: the other cannot go on

        async with trio.open_nursery() as nursery:
            nursery.start_soon(guarded, client_to_guest, nursery.cancel_scope)
            nursery.start_soon(guarded, guest_to_client, nursery.cancel_scope)

    async def _drop_upstream(self) -> None:
        if self.upstream is not None:
            upstream, self.upstream = self.upstream, None
            await upstream.aclose()


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("ascii", "replace")
