"""The data plane's file endpoints (docs/dataplane.md, "Files"): the guest's ``files``
requests over plain HTTP, with a session credential that grants ``files``.

::

    GET  /v1/files/stat?path=P                   → {"result": {"entry"}}
    GET  /v1/files/list?path=P&depth=N           → JSON lines, one entry each
    POST /v1/files/mkdir  {path, parents?, mode?, uid?, gid?, user?}  → {"result": {entry, created}}
    POST /v1/files/move   {source, destination}  → {"result": {entry}}
    POST /v1/files/remove {path, recursive?}     → {"result": {}}
    GET  /v1/files/content?path=P                → the file's bytes
    PUT  /v1/files/content?path=P[&mode=&uid=&gid=&user=&mtime_ns=&parents=]  ← the bytes
    GET  /v1/files/tar?path=P[&arcname=N]        → P as a tar stream
    PUT  /v1/files/tar?path=DIR[&user=]          ← a tar stream, unpacked into DIR
    GET  /v1/files/watch?path=DIR[&recursive=]   → JSON lines {name, type}, until closed

Bodies stream both ways with bounded memory: a download is read from the guest only as
fast as the client takes it, an upload goes to the guest only as fast as the guest's
credit allows.  A download ends with the trailers ``Kibotos-Bytes`` and
``Kibotos-Sha256`` (the guest's count and digest); an upload may carry the client's
``Kibotos-Sha256`` as a header or a trailer, which the guest checks before anything is
renamed into place.  ``user`` (a guest user name, `check_user_name`) owns what a
write creates; an agent too old for it refuses any but root (docs/guest-protocol.md).
Errors before the body are JSON with the API's error body; an error
during a download is the trailer ``Kibotos-Error`` (JSON) when the client sent ``TE:
trailers``, and otherwise the connection ends without the chunked terminator, which
every HTTP client reports as a truncated body.

A watch (the guest's ``file_watch``) has no end of its own: it streams the directory's
changes until the client closes the connection, which cancels the watch in the guest,
or until the directory goes (then it ends like a download, with its trailers).
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

import trio

from kibotos.core.credentials import SessionClaims
from kibotos.core.errors import InvalidArgument, KibotosError, NotFound, Unavailable
from kibotos.core.logs import EventLogger
from kibotos.dataplane.clients.user_name import optional_user_name
from kibotos.dataplane.endpoints.http1 import HttpExchange, error_status
from kibotos.dataplane.process.groups import sole_error
from kibotos.dataplane.process.metrics import DataplaneMetrics
from kibotos.guest import GuestChannel
from kibotos.guest.files import Download, GuestFiles, Upload

log = EventLogger("kibotos.dataplane")

FILES_PREFIX = "/v1/files/"
_ROUTES = {("GET", "stat"), ("GET", "list"), ("POST", "mkdir"), ("POST", "move"),
           ("POST", "remove"), ("GET", "content"), ("PUT", "content"), ("GET", "tar"),
           ("PUT", "tar"), ("GET", "watch")}
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_MAX_JSON = 64 * 1024
#: How long the guest may take to answer a request (a transfer's bytes are not timed).
GUEST_TIMEOUT = 60.0
#: The guest credit of a transfer: more in flight than the channel's default 256 KiB
#: keeps both ends busy across the extra hop (still bounded, per transfer).
DOWNLOAD_WINDOW = UPLOAD_WINDOW = 1 << 20


def route(exchange: HttpExchange) -> str:
    """The endpoint's name, or NotFound (before any credential is looked at, so a typo
    reads as a typo)."""
    name = exchange.path[len(FILES_PREFIX):] if exchange.path.startswith(FILES_PREFIX) \
        else ""
    if (exchange.method, name) not in _ROUTES:
        if any(n == name for _, n in _ROUTES):
            raise InvalidArgument(f"{exchange.method} is not allowed on {exchange.path}")
        raise NotFound(f"no such data-plane endpoint: {exchange.method} {exchange.path}")
    return name


# ---------------------------------------------------------------------------- parameters


def _text(params: dict[str, Any], key: str, *, required: bool = True) -> str | None:
    value = params.get(key)
    if value is None:
        if required:
            raise InvalidArgument(f"{key} is required")
        return None
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{key} must be a non-empty string")
    return value


def _path(params: dict[str, Any], key: str = "path") -> str:
    value = _text(params, key)
    assert value is not None
    if not value.startswith("/"):
        raise InvalidArgument(f"{key} must be an absolute guest path, got {value!r}")
    return value


def _int(params: dict[str, Any], key: str, lo: int, hi: int, *, base: int = 10) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, str):  # a query parameter
        try:
            value = int(value, base)
        except ValueError:
            raise InvalidArgument(f"{key} must be an integer{' in octal' if base == 8 else ''}"
                                  f", got {value!r}") from None
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise InvalidArgument(f"{key} must be an integer from {lo} to {hi}, got {value!r}")
    return value


def _bool(params: dict[str, Any], key: str, default: bool) -> bool:
    value = params.get(key, default)
    if isinstance(value, str):
        if value not in ("true", "false"):
            raise InvalidArgument(f"{key} must be true or false, got {value!r}")
        return value == "true"
    if not isinstance(value, bool):
        raise InvalidArgument(f"{key} must be true or false, got {value!r}")
    return value


def _only(params: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise InvalidArgument(f"unknown parameters {unknown}")


def _digest(value: str | None, where: str) -> str | None:
    if value is None:
        return None
    value = value.strip().lower()
    if not _DIGEST.fullmatch(value):
        raise InvalidArgument(f"{where} must be 'sha256:' and 64 hex digits")
    return value


async def _json_body(exchange: HttpExchange) -> dict[str, Any]:
    raw = await exchange.read_body(_MAX_JSON)
    try:
        body = json.loads(raw or b"{}")
    except ValueError as exc:
        raise InvalidArgument(f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return body


# ---------------------------------------------------------------------------- serving


class FilesRequest:
    """One file request against one guest."""

    def __init__(self, exchange: HttpExchange, channel: GuestChannel, claims: SessionClaims,
                 metrics: DataplaneMetrics) -> None:
        self.ex = exchange
        self.files = GuestFiles(channel)
        self.claims = claims
        self.metrics = metrics

    async def run(self, name: str) -> None:
        try:
            await getattr(self, f"_{self.ex.method.lower()}_{name}")()
            outcome = "ok"
        except KibotosError as exc:
            outcome = exc.code
            log.info("file request failed", request=name, instance_id=self.claims.instance_id,
                     code=exc.code, error=exc.message, credential=self.claims.jti)
            if not self.ex.responded:
                await self.ex.respond_error(exc)
        self.metrics.files_requests.labels(name, outcome).inc()

    async def _guest(self, call: Any) -> Any:
        with trio.move_on_after(GUEST_TIMEOUT) as scope:
            return await call
        assert scope.cancelled_caught
        raise Unavailable(f"the guest of Instance {self.claims.instance_id} did not answer "
                          f"within {GUEST_TIMEOUT:g}s")

    # -- metadata

    async def _get_stat(self) -> None:
        params = self.ex.query()
        _only(params, {"path"})
        entry = await self._guest(self.files.stat(_path(params)))
        await self.ex.respond_json(200, {"result": {"entry": entry.to_wire()}})

    async def _post_mkdir(self) -> None:
        body = await _json_body(self.ex)
        _only(body, {"path", "parents", "mode", "uid", "gid", "user"})
        mode = _int(body, "mode", 0, 0o7777)
        entry, created = await self._guest(self.files.mkdir(
            _path(body), parents=_bool(body, "parents", True),
            mode=0o755 if mode is None else mode, uid=_int(body, "uid", 0, 2**32 - 2),
            gid=_int(body, "gid", 0, 2**32 - 2), user=optional_user_name(body.get("user"))))
        await self.ex.respond_json(200, {"result": {"entry": entry.to_wire(),
                                                    "created": created}})

    async def _post_move(self) -> None:
        body = await _json_body(self.ex)
        _only(body, {"source", "destination"})
        entry = await self._guest(self.files.move(_path(body, "source"),
                                                  _path(body, "destination")))
        await self.ex.respond_json(200, {"result": {"entry": entry.to_wire()}})

    async def _post_remove(self) -> None:
        body = await _json_body(self.ex)
        _only(body, {"path", "recursive"})
        await self._guest(self.files.remove(_path(body),
                                            recursive=_bool(body, "recursive", False)))
        await self.ex.respond_json(200, {"result": {}})

    # -- downloads

    async def _get_list(self) -> None:
        params = self.ex.query()
        _only(params, {"path", "depth"})
        depth = _int(params, "depth", 1, 64) or 1
        down = await self._guest(self.files.open_list(_path(params), depth=depth,
                                                           window=DOWNLOAD_WINDOW))
        await self._stream_down(down, "application/x-ndjson", [])

    async def _get_content(self) -> None:
        params = self.ex.query()
        _only(params, {"path"})
        down = await self._guest(self.files.open_read(_path(params),
                                                      window=DOWNLOAD_WINDOW))
        entry = down.entry
        await self._stream_down(down, "application/octet-stream", [
            ("Kibotos-Entry", json.dumps(entry.to_wire(), separators=(",", ":"))),
            ("Kibotos-Size", str(entry.size))])

    async def _get_tar(self) -> None:
        params = self.ex.query()
        _only(params, {"path", "arcname"})
        down = await self._guest(self.files.open_tar_read(
            _path(params), arcname=_text(params, "arcname", required=False),
            window=DOWNLOAD_WINDOW))
        await self._stream_down(down, "application/x-tar", [
            ("Kibotos-Entry", json.dumps(down.entry.to_wire(), separators=(",", ":")))])

    async def _get_watch(self) -> None:
        params = self.ex.query()
        _only(params, {"path", "recursive"})
        down = await self._guest(self.files.open_watch(
            _path(params), recursive=_bool(params, "recursive", False),
            window=DOWNLOAD_WINDOW))
        try:
            async with trio.open_nursery() as nursery:
                # Nothing else tells a quiet watch that its client left.
                nursery.start_soon(self._cancel_when_client_leaves, nursery.cancel_scope)
                await self._stream_down(down, "application/x-ndjson", [
                    ("Kibotos-Entry", json.dumps(down.entry.to_wire(),
                                                 separators=(",", ":")))])
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # the stream's own error, as run() expects it
            error = sole_error(group)
            if error is None:
                raise
            raise error from None

    async def _cancel_when_client_leaves(self, scope: trio.CancelScope) -> None:
        await self.ex.wait_client_closed()
        scope.cancel()

    async def _stream_down(self, down: Download, content_type: str,
                           headers: list[tuple[str, str]]) -> None:
        async with down:
            await self.ex.start_stream(200, content_type, [
                *headers, ("Trailer", "Kibotos-Bytes, Kibotos-Sha256, Kibotos-Error")])
            try:
                async for chunk in down.stream:
                    await self.ex.send(chunk)
                    self.metrics.files_bytes.labels("download").inc(len(chunk))
                done = await down.result()
            except trio.BrokenResourceError as exc:  # the guest's error, mid-stream
                cause = exc.__cause__
                error = cause if isinstance(cause, KibotosError) else Unavailable(str(exc))
                await self._end_with_error(error)
                raise error from None
            except KibotosError as exc:
                await self._end_with_error(exc)
                raise
            await self.ex.end([("Kibotos-Bytes", str(done.bytes)),
                               ("Kibotos-Sha256", done.sha256)])

    async def _end_with_error(self, exc: KibotosError) -> None:
        if self.ex.trailers_ok:
            body = json.dumps({**exc.to_wire()["error"], "status": error_status(exc)},
                              separators=(",", ":"))
            await self.ex.end([("Kibotos-Error", body)])
        # Otherwise no terminating chunk: the client sees a truncated body, not success.

    # -- uploads

    async def _put_content(self) -> None:
        params = self.ex.query()
        _only(params, {"path", "mode", "uid", "gid", "user", "mtime_ns", "parents"})
        up = await self._guest(self.files.open_write(
            _path(params), mode=_int(params, "mode", 0, 0o7777, base=8),
            uid=_int(params, "uid", 0, 2**32 - 2), gid=_int(params, "gid", 0, 2**32 - 2),
            mtime_ns=_int(params, "mtime_ns", -(2**62), 2**62),
            parents=_bool(params, "parents", False), window=UPLOAD_WINDOW,
            user=optional_user_name(params.get("user"))))
        await self._stream_up(up)

    async def _put_tar(self) -> None:
        params = self.ex.query()
        _only(params, {"path", "user"})
        await self._stream_up(await self._guest(self.files.open_tar_write(
            _path(params), window=UPLOAD_WINDOW, user=optional_user_name(params.get("user")))))

    async def _stream_up(self, up: Upload) -> None:
        async with up:
            expected = _digest(self.ex.headers.get("kibotos-sha256"), "Kibotos-Sha256")
            with contextlib.suppress(trio.BrokenResourceError):  # the guest stopped taking
                async for chunk in self.ex.body():  # bytes: commit raises its reason
                    await up.stream.send_all(chunk)
                    self.metrics.files_bytes.labels("upload").inc(len(chunk))
            if up.error is None:
                trailer = _digest(self.ex.trailers.get("kibotos-sha256"), "Kibotos-Sha256")
                if expected and trailer and trailer != expected:
                    raise InvalidArgument("the Kibotos-Sha256 header and trailer differ")
                expected = expected or trailer
            done = await self._guest(up.commit(expected))
        await self.ex.respond_json(200, {"result": done.body})
