"""The Connect protocol (connectrpc.com/docs/protocol) on the server side, over
Starlette, for envd's services: unary calls and server streams, in the JSON and the
binary protobuf encodings, without compression.

Messages are Google's ``protobuf`` classes generated from envd's ``.proto`` files
(`third_party/envd`); their JSON form is `google.protobuf.json_format`'s proto3 JSON, which is
what the Connect JSON codec is.  What is left here is the protocol itself: the content
types, a stream's envelopes (one flag byte, a 4-byte big-endian length, the message;
flag 0x02 marks the end-of-stream message, which carries the error if there is one)
and the error body ``{"code", "message"}`` with the HTTP status of its code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kibotos.core.errors import Internal, InvalidArgument, KibotosError

log = logging.getLogger("kibotos.gateway.e2b")

Req = TypeVar("Req", bound=Message)
#: Connect's codes as HTTP statuses (the protocol's table); kibotos error codes are
#: Connect codes already, by name.
HTTP_STATUS = {"canceled": 499, "unknown": 500, "invalid_argument": 400,
               "deadline_exceeded": 504, "not_found": 404, "already_exists": 409,
               "permission_denied": 403, "resource_exhausted": 429,
               "failed_precondition": 400, "aborted": 409, "out_of_range": 400,
               "unimplemented": 501, "internal": 500, "unavailable": 503,
               "data_loss": 500, "unauthenticated": 401}
END_STREAM, COMPRESSED = 0x02, 0x01
_HEADER = struct.Struct(">BI")
MAX_MESSAGE = 4 << 20


class Unimplemented(KibotosError):
    code = "unimplemented"
    http_status = 501
    exit_code = 1


@dataclass(frozen=True)
class Codec:
    name: str  # "json" | "proto"

    def decode(self, data: bytes, cls: type[Req]) -> Req:
        message = cls()
        try:
            if self.name == "json":
                json_format.Parse(data or b"{}", message, ignore_unknown_fields=True)
            else:
                message.ParseFromString(data)
        except (json_format.ParseError, DecodeError, ValueError) as exc:
            raise InvalidArgument(f"cannot parse {cls.DESCRIPTOR.full_name}: {exc}") \
                from None
        return message

    def encode(self, message: Message) -> bytes:
        if self.name == "json":
            return json_format.MessageToJson(message, indent=None).encode()
        return message.SerializeToString()


def _codec(request: Request, prefix: str) -> Codec:
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    for name in ("json", "proto"):
        if kind == f"{prefix}{name}":
            return Codec(name)
    raise InvalidArgument(f"unsupported content type {kind!r}: expected {prefix}json or "
                          f"{prefix}proto")


def error_body(exc: KibotosError) -> dict[str, Any]:
    return {"code": exc.code if exc.code in HTTP_STATUS else "unknown", "message": exc.message}


def unary_error(exc: KibotosError) -> JSONResponse:
    body = error_body(exc)
    return JSONResponse(body, status_code=HTTP_STATUS[body["code"]])


def envelope(payload: bytes, flags: int = 0) -> bytes:
    return _HEADER.pack(flags, len(payload)) + payload


async def _one_envelope(request: Request) -> bytes:
    """The single message of a server-streaming request, read as soon as it is whole:
    a client may keep its request body open (the SDK sends it as a bidirectional
    stream), so the end of the body is not waited for."""
    data = bytearray()
    async with contextlib.aclosing(request.stream()) as stream:
        async for chunk in stream:
            data += chunk
            if len(data) < _HEADER.size:
                continue
            flags, size = _HEADER.unpack_from(data)
            if flags & COMPRESSED:
                raise InvalidArgument("compressed messages are not supported (send identity)")
            if size > MAX_MESSAGE:
                raise InvalidArgument(f"the request is larger than {MAX_MESSAGE} bytes")
            if len(data) >= _HEADER.size + size:
                return bytes(data[_HEADER.size:_HEADER.size + size])
    raise InvalidArgument("the stream request ended before its message")


async def _read(request: Request) -> bytes:
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_MESSAGE:
            raise InvalidArgument(f"the request is larger than {MAX_MESSAGE} bytes")
    return bytes(data)


def _unexpected(exc: Exception, what: str) -> Internal:
    log.exception("unexpected error in %s", what)
    return Internal(f"internal error: {type(exc).__name__}")


Authorize = Callable[[Request], Awaitable[Any]]


def unary(cls: type[Req], authorize: Authorize,
          handler: Callable[[Req, Any], Awaitable[Message]]
          ) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint for a unary method: `authorize` gives the call's context."""

    async def endpoint(request: Request) -> Response:
        try:
            codec = _codec(request, "application/")
            context = await authorize(request)
            answer = await handler(codec.decode(await _read(request), cls), context)
            return Response(codec.encode(answer), media_type=f"application/{codec.name}")
        except KibotosError as exc:
            return unary_error(exc)
        except Exception as exc:
            return unary_error(_unexpected(exc, request.url.path))

    return endpoint


def server_stream(cls: type[Req], authorize: Authorize,
                  handler: Callable[[Req, Any], AsyncIterator[Message]]
                  ) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint for a server-streaming method; an error, before or during
    the stream, is the end-of-stream message's."""

    async def endpoint(request: Request) -> Response:
        try:
            codec = _codec(request, "application/connect+")
        except KibotosError as exc:
            return unary_error(exc)
        media = f"application/connect+{codec.name}"
        # The request's message is read here, before the response starts: Starlette's
        # streaming response reads the rest of the request itself (to notice a client
        # that goes away), so nothing inside the stream may read it.
        failure: KibotosError | None = None
        try:
            context = await authorize(request)
            message = codec.decode(await _one_envelope(request), cls)
        except KibotosError as exc:
            failure = exc

        async def frames() -> AsyncIterator[bytes]:
            end: dict[str, Any] = {}
            try:
                if failure is not None:
                    raise failure
                async for answer in handler(message, context):
                    yield envelope(codec.encode(answer))
            except KibotosError as exc:
                end = {"error": error_body(exc)}
            except Exception as exc:
                end = {"error": error_body(_unexpected(exc, request.url.path))}
            yield envelope(json.dumps(end).encode(), END_STREAM)

        return StreamingResponse(frames(), media_type=media)

    return endpoint
