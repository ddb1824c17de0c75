"""envd's ``filesystem.Filesystem`` service and its REST ``/files``, over the data
plane's file endpoints (`kibotos.dataplane.clients.files_client`).

``GET /files?path=`` streams the file; ``POST /files?path=`` takes a
``multipart/form-data`` body (one part per file, the SDK's default for text and bytes)
or ``application/octet-stream`` (``Content-Encoding: gzip`` allowed), creates the
parent directories, and answers ``[{path, name, type}]``.  Bodies stream both ways:
neither is held in memory whole (a multipart part is spooled by Starlette's parser).
REST errors are envd's ``{"code": <status>, "message"}``.  ``MakeDir`` and uploads
create as the call's user (what they make, parents included, is its); ``username`` on
``/files`` names it there, as the SDK sends it.  Reads, moves and removes act as the
guest agent's user.  ``WatchDir`` and the
watcher calls are `envd_watch`'s.
"""

from __future__ import annotations

import posixpath
import zlib
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kibotos.core.errors import AlreadyExists, InvalidArgument, KibotosError
from kibotos.dataplane.clients.files_client import FilesClient
from kibotos.dataplane.clients.user_name import check_user_name
from kibotos.gateway.e2b.third_party.envd import filesystem_pb2 as pb
from kibotos.guest.files import FileEntry

CHUNK = 256 * 1024
_TYPES = {"file": pb.FILE_TYPE_FILE, "directory": pb.FILE_TYPE_DIRECTORY,
          "symlink": pb.FILE_TYPE_SYMLINK}
#: kibotos error codes as envd's REST statuses.
_REST_STATUS = {"invalid_argument": 400, "unauthenticated": 401, "permission_denied": 403,
                "not_found": 404, "already_exists": 409, "failed_precondition": 400,
                "resource_exhausted": 507, "unavailable": 502, "deadline_exceeded": 504}


def entry_info(entry: FileEntry) -> pb.EntryInfo:
    stamp = Timestamp()
    stamp.FromNanoseconds(entry.mtime_ns)
    info = pb.EntryInfo(
        name=entry.name, type=_TYPES.get(entry.type, pb.FILE_TYPE_UNSPECIFIED),
        path=entry.path, size=entry.size, mode=entry.mode & 0o7777,
        permissions=entry.permissions, owner=entry.owner, group=entry.group,
        modified_time=stamp, is_symlink=entry.type == "symlink")
    if entry.symlink_target is not None:
        info.symlink_target = entry.symlink_target
    return info


def rest_error(exc: KibotosError) -> JSONResponse:
    status = _REST_STATUS.get(exc.code, 500)
    return JSONResponse({"code": status, "message": exc.message}, status_code=status)


async def _files(call: Any) -> FilesClient:
    session = await call.session()
    return FilesClient(session.url, session.credential, ssl_context=session.tls)


class FilesystemService:
    async def stat(self, request: pb.StatRequest, call: Any) -> Message:
        entry = await (await _files(call)).stat(request.path)
        return pb.StatResponse(entry=entry_info(entry))

    async def make_dir(self, request: pb.MakeDirRequest, call: Any) -> Message:
        entry, created = await (await _files(call)).mkdir(request.path, parents=True,
                                                          user=call.user)
        if not created:
            raise AlreadyExists(f"directory {request.path} already exists")
        return pb.MakeDirResponse(entry=entry_info(entry))

    async def move(self, request: pb.MoveRequest, call: Any) -> Message:
        entry = await (await _files(call)).move(request.source, request.destination)
        return pb.MoveResponse(entry=entry_info(entry))

    async def list_dir(self, request: pb.ListDirRequest, call: Any) -> Message:
        entries = await (await _files(call)).list(request.path, depth=request.depth or 1)
        return pb.ListDirResponse(entries=[entry_info(e) for e in entries])

    async def remove(self, request: pb.RemoveRequest, call: Any) -> Message:
        await (await _files(call)).remove(request.path, recursive=True)
        return pb.RemoveResponse()


# ---------------------------------------------------------------------------- REST


def _query_path(request: Request) -> str | None:
    path = request.query_params.get("path")
    return path or None


async def download(request: Request, call: Any) -> Response:
    path = _query_path(request)
    if path is None:
        raise InvalidArgument("path is required")
    _query_user(request, call)  # checked; a read acts as the guest agent's user
    files = await _files(call)
    stack = AsyncExitStack()
    down = await stack.enter_async_context(files.download("content", path))

    async def body() -> AsyncIterator[bytes]:
        async with stack:
            async for chunk in down.chunks():
                yield chunk

    headers = {} if down.size is None else {"Content-Length": str(down.size)}
    return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)


async def _chunks_of(part: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await part.read(CHUNK):
        yield chunk


async def _request_chunks(request: Request, gzip: bool) -> AsyncIterator[bytes]:
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzip else None
    async for chunk in request.stream():
        if inflate is None:
            if chunk:
                yield chunk
            continue
        try:
            out = inflate.decompress(chunk)
        except zlib.error as exc:
            raise InvalidArgument(f"the gzip body is corrupt: {exc}") from None
        if out:
            yield out
    if inflate is not None:
        tail = inflate.flush()
        if tail:
            yield tail


def _query_user(request: Request, call: Any) -> str | None:
    """``username`` of REST ``/files`` (the SDK's way there), else the Authorization
    header's user."""
    name = request.query_params.get("username")
    user: str | None = call.user if name is None else check_user_name(name, "username")
    return user


def _written(path: str) -> dict[str, str]:
    return {"path": path, "name": posixpath.basename(path), "type": "file"}


async def upload(request: Request, call: Any) -> Response:
    files = await _files(call)
    path = _query_path(request)
    user = _query_user(request, call)
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    written = []
    if kind == "multipart/form-data":
        async with request.form(max_files=1000, max_fields=1000) as form:
            parts = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
            if not parts:
                raise InvalidArgument("the multipart body has no file part")
            for part in parts:
                target = path if path is not None and len(parts) == 1 else part.filename
                if not target:
                    raise InvalidArgument("a file part names no path (its filename)")
                await files.upload("content", target, _chunks_of(part), parents="true",
                                   user=user)
                written.append(_written(target))
    else:
        if path is None:
            raise InvalidArgument("path is required for an octet-stream upload")
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding not in ("identity", "gzip"):
            raise InvalidArgument(f"unsupported Content-Encoding {encoding!r}")
        await files.upload("content", path, _request_chunks(request, encoding == "gzip"),
                           parents="true", user=user)
        written.append(_written(path))
    return JSONResponse(written)
