"""The client end of the data plane's file endpoints (`files_api`): what ``kibo
workspace cp`` uses, and a gateway may.

::

    client = FilesClient(session["dataplane_url"], session["credential"])
    entry = await client.stat("/etc/hostname")
    async with client.download("content", "/var/log/syslog") as down:
        async for chunk in down.chunks(): ...
    # down.result: the guest's count and sha256, checked against the bytes received
    result = await client.upload("content", "/srv/a.bin", chunks, mode=0o644)

One request per connection, on h11 (httpx buffers neither way, but cannot send
trailers or read them).  Uploads announce ``Expect: 100-continue``, so a refusal (a
credential, a missing directory, permission) arrives before any byte is sent, and carry
their sha256 as a trailer, computed while sending: the guest checks it before renaming
anything into place, and the client compares the guest's own digest with it.  Downloads
ask for trailers (``TE: trailers``) and compare the guest's ``Kibotos-Sha256`` with what
arrived.  Memory is bounded by one chunk in flight.
"""

from __future__ import annotations

import hashlib
import json
import ssl
import urllib.parse
from collections.abc import AsyncIterable, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import h11
import trio

from kibotos.core.errors import (
    Internal,
    InvalidArgument,
    KibotosError,
    Unavailable,
    error_from_wire,
)
from kibotos.dataplane.clients.tls_client import connect_dataplane
from kibotos.dataplane.clients.user_name import check_user_name
from kibotos.dataplane.endpoints.files_api import FILES_PREFIX
from kibotos.guest.files import FileEntry

RECEIVE_CHUNK = 256 * 1024
_STATUS_CODES = {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied",
                 404: "not_found", 409: "already_exists", 412: "failed_precondition",
                 429: "resource_exhausted", 503: "unavailable", 507: "resource_exhausted"}


class DigestMismatch(Internal):
    """What arrived does not hash to what the guest sent: the transfer was corrupted."""


class _Connection:
    """One HTTP/1.1 exchange on its own connection."""

    def __init__(self, stream: trio.abc.Stream, url: str) -> None:
        self.stream = stream
        self.url = url
        self.conn = h11.Connection(h11.CLIENT)
        self.response: h11.Response | None = None
        self.trailers: dict[str, str] = {}

    async def send(self, event: Any) -> None:
        data = self.conn.send(event)
        if data:
            await self.stream.send_all(data)

    async def next_event(self) -> Any:
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise Unavailable(f"the data plane at {self.url} broke the HTTP exchange: "
                                  f"{exc}") from None
            if event is not h11.NEED_DATA:
                return event
            try:
                data = await self.stream.receive_some(RECEIVE_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise Unavailable(f"the connection to the data plane at {self.url} "
                                  f"broke: {exc}") from None
            self.conn.receive_data(bytes(data))

    async def read_response(self) -> h11.Response:
        """The final response head (100 Continue is skipped)."""
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Response):
                self.response = event
                return event
            if not isinstance(event, h11.InformationalResponse):
                raise Unavailable(f"the data plane at {self.url} sent {type(event).__name__} "
                                  "instead of a response")

    async def next_chunk(self) -> bytes | None:
        """The next piece of the answer's body, None at its end (trailers read)."""
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Data):
                return bytes(event.data)
            if isinstance(event, h11.EndOfMessage):
                self.trailers = {k.decode("latin-1").lower(): v.decode("latin-1")
                                 for k, v in event.headers}
                return None
            if isinstance(event, h11.ConnectionClosed):
                raise Unavailable(f"the data plane at {self.url} closed the connection "
                                  "before the end of the answer")

    async def read_body(self, limit: int = 16 << 20) -> bytes:
        data = bytearray()
        while (chunk := await self.next_chunk()) is not None:
            data += chunk
            if len(data) > limit:
                raise Internal(f"the data plane's answer is larger than {limit} bytes")
        return bytes(data)

    async def error(self) -> KibotosError:
        """The error a non-2xx answer carries (the API's JSON error body)."""
        assert self.response is not None
        status = self.response.status_code
        try:
            body = json.loads(await self.read_body(1 << 20))
        except (ValueError, KibotosError):
            body = None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return error_from_wire(body)
        return error_from_wire({"error": {
            "code": _STATUS_CODES.get(status, "internal"),
            "message": f"the data plane at {self.url} answered HTTP {status}"}})


def _entry_or_none(body: Any) -> FileEntry | None:
    return FileEntry.from_wire(body) if isinstance(body, dict) else None


class Download:
    """A streamed answer: `chunks` once, then `result` (the guest's count and digest,
    already checked against what arrived)."""

    def __init__(self, connection: _Connection) -> None:
        self._c = connection
        assert connection.response is not None
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in connection.response.headers}
        self.headers = headers
        raw = headers.get("kibotos-entry")
        self.entry = _entry_or_none(json.loads(raw)) if raw else None
        size = headers.get("kibotos-size", "")
        self.size = int(size) if size.isdigit() else None
        self.received = 0
        self.sha256 = ""
        self._digest = hashlib.sha256()

    def chunks(self) -> Download:
        """Iterate the body (this object is its own iterator: leaving the loop early
        needs no cleanup); the digest is checked at the end."""
        return self

    def __aiter__(self) -> Download:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._c.next_chunk()
        if chunk is None:
            self._check()
            raise StopAsyncIteration
        self._digest.update(chunk)
        self.received += len(chunk)
        return chunk

    def _check(self) -> None:
        trailers = self._c.trailers
        if "kibotos-error" in trailers:
            try:
                body = json.loads(trailers["kibotos-error"])
            except ValueError:
                body = {"code": "internal", "message": trailers["kibotos-error"]}
            raise error_from_wire({"error": body})
        digest = "sha256:" + self._digest.hexdigest()
        sent, count = trailers.get("kibotos-sha256"), trailers.get("kibotos-bytes")
        if sent is None or count is None:
            raise Unavailable(f"the data plane at {self._c.url} ended the download without "
                              "its digest")
        if sent != digest or count != str(self.received):
            raise DigestMismatch(f"received {self.received} bytes with {digest}, but the "
                                 f"guest sent {count} bytes with {sent}")
        self.sha256 = digest


class FilesClient:
    """The file endpoints of one data plane, with one session credential."""

    def __init__(self, dataplane_url: str, credential: str | None, *,
                 connect_timeout: float = 30.0, ssl_context: ssl.SSLContext | None = None
                 ) -> None:
        parts = urllib.parse.urlsplit(dataplane_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgument(f"data-plane URL {dataplane_url!r} must be "
                                  "http(s)://host:port")
        self.base = dataplane_url.rstrip("/")
        self._parts = parts
        self._credential = credential
        self._timeout = connect_timeout
        self._ssl = ssl_context

    async def _connect(self) -> _Connection:
        host, tls = self._parts.hostname or "", self._parts.scheme == "https"
        port = self._parts.port or (443 if tls else 80)
        stream = await connect_dataplane(host, port, tls=tls, context=self._ssl,
                                         url=self.base, timeout=self._timeout)
        return _Connection(stream, self.base)

    def _head(self, method: str, name: str, params: dict[str, Any],
              extra: list[tuple[str, str]]) -> h11.Request:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        target = f"{self._parts.path.rstrip('/')}{FILES_PREFIX}{name}" + (
            f"?{query}" if query else "")
        headers = [("Host", self._parts.netloc), ("Connection", "close"), *extra]
        if self._credential is not None:
            headers.append(("Authorization", f"Bearer {self._credential}"))
        return h11.Request(method=method, target=target, headers=headers)

    @asynccontextmanager
    async def _exchange(self, method: str, name: str, params: dict[str, Any],
                        extra: list[tuple[str, str]]) -> AsyncIterator[_Connection]:
        c = await self._connect()
        try:
            await c.send(self._head(method, name, params, extra))
            yield c
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise Unavailable(f"the connection to the data plane at {self.base} broke: "
                              f"{exc}") from None
        finally:
            await trio.aclose_forcefully(c.stream)

    async def _json(self, method: str, name: str, params: dict[str, Any] | None = None,
                    body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else b""
        extra = [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
        async with self._exchange(method, name, params or {}, extra) as c:
            if data:
                await c.send(h11.Data(data=data))
            await c.send(h11.EndOfMessage())
            response = await c.read_response()
            if response.status_code != 200:
                raise await c.error()
            try:
                answer = json.loads(await c.read_body())
            except ValueError:
                raise Internal(f"the data plane at {self.base} sent a non-JSON answer") \
                    from None
        result = answer.get("result") if isinstance(answer, dict) else None
        if not isinstance(result, dict):
            raise Internal(f"the data plane at {self.base} sent {answer!r}")
        return result

    # -- metadata

    async def stat(self, path: str) -> FileEntry:
        return FileEntry.from_wire((await self._json("GET", "stat", {"path": path}))["entry"])

    async def mkdir(self, path: str, *, parents: bool = True, mode: int | None = None,
                    user: str | None = None) -> tuple[FileEntry, bool]:
        """`user` (a guest user name) owns the directory and the parents it made."""
        body: dict[str, Any] = {"path": path, "parents": parents}
        if mode is not None:
            body["mode"] = mode
        if user is not None:
            body["user"] = check_user_name(user)
        result = await self._json("POST", "mkdir", body=body)
        return FileEntry.from_wire(result["entry"]), result.get("created") is True

    async def move(self, source: str, destination: str) -> FileEntry:
        result = await self._json("POST", "move",
                                  body={"source": source, "destination": destination})
        return FileEntry.from_wire(result["entry"])

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._json("POST", "remove", body={"path": path, "recursive": recursive})

    async def list(self, path: str, *, depth: int = 1) -> list[FileEntry]:
        async with self.download("list", path, depth=depth) as down:
            lines = bytearray()
            async for chunk in down.chunks():
                lines += chunk
        return [FileEntry.from_wire(json.loads(line)) for line in lines.splitlines() if line]

    # -- transfers

    @asynccontextmanager
    async def download(self, name: str, path: str, **params: Any) -> AsyncIterator[Download]:
        """``content`` (a file), ``tar`` (a tree) or ``list``; read `chunks` inside."""
        async with self._exchange("GET", name, {"path": path, **params},
                                  [("TE", "trailers")]) as c:
            await c.send(h11.EndOfMessage())
            response = await c.read_response()
            if response.status_code != 200:
                raise await c.error()
            yield Download(c)

    async def upload(self, name: str, path: str, chunks: AsyncIterable[bytes],
                     **params: Any) -> dict[str, Any]:
        """Send `chunks` to ``content`` (a file) or ``tar`` (into a directory); returns
        the guest's answer, whose digest matched the bytes sent.  ``user=NAME`` among
        `params`: that guest user owns what it creates."""
        if params.get("user") is not None:
            check_user_name(params["user"])
        digest = hashlib.sha256()
        sent = 0
        extra = [("Content-Type", "application/octet-stream"),
                 ("Transfer-Encoding", "chunked"), ("Expect", "100-continue"),
                 ("Trailer", "Kibotos-Sha256")]
        async with self._exchange("PUT", name, {"path": path, **params}, extra) as c:
            go = trio.Event()

            async def send_body() -> None:
                nonlocal sent
                await go.wait()
                try:
                    async for chunk in chunks:
                        digest.update(chunk)
                        sent += len(chunk)
                        await c.send(h11.Data(data=chunk))
                    await c.send(h11.EndOfMessage(headers=[
                        ("Kibotos-Sha256", "sha256:" + digest.hexdigest())]))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # the data plane answered early and left: the answer says why

            failure: KibotosError | None = None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_body)
                response = await self._continue(c, go)
                if response is None:
                    response = await c.read_response()
                if response.status_code != 200:
                    failure = await c.error()
                    nursery.cancel_scope.cancel()  # stop sending what will not be read
                else:
                    raw = await c.read_body()
            if failure is not None:
                raise failure
            answer = json.loads(raw).get("result")
        if not isinstance(answer, dict):
            raise Internal(f"the data plane at {self.base} sent {raw[:200]!r}")
        mine = "sha256:" + digest.hexdigest()
        if answer.get("sha256") != mine or answer.get("bytes") != sent:
            raise DigestMismatch(f"sent {sent} bytes with {mine}, but the guest wrote "
                                 f"{answer.get('bytes')} bytes with {answer.get('sha256')}")
        return answer

    async def _continue(self, c: _Connection, go: trio.Event) -> h11.Response | None:
        """Wait for 100 Continue (then release the body) or an early final answer."""
        event = await c.next_event()
        if isinstance(event, h11.InformationalResponse):
            go.set()
            return None
        if isinstance(event, h11.Response):
            c.response = event
            return event
        raise Unavailable(f"the data plane at {self.base} sent {type(event).__name__}")
