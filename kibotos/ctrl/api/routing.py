"""The route table every API module contributes to, and what each handler shares.

A `Route` names its method, path, handler and summary, who may call it (operators
unless it says otherwise), and its body, query and result models.  `app.py` turns the
table into Starlette routes, and `openapi.py` into the OpenAPI document, so the two
cannot disagree.  The ``who`` column is enforced here, in one wrapper, before a handler
runs: a handler never forgets to authenticate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, TypeVar

from pydantic import BaseModel
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kibotos.core import ids
from kibotos.core.errors import InvalidArgument
from kibotos.ctrl.api.auth import Authenticator, Caller
from kibotos.ctrl.live.context import CtrlContext
from kibotos.ctrl.store.journal import Journal, Txn
from kibotos.ctrl.wire.base import WaitQuery, WriteRequest
from kibotos.protocol import json_text

#: The service call a plain write on one object is: its ID, the checked body, and the
#: caller's identity for the journal.
ObjectWrite = Callable[[str, Any, str | None], Awaitable[Any]]

Who = Literal["anyone", "identity", "operator", "node"]
Handler = Callable[[Request, Caller | None], Awaitable[Any]]
M = TypeVar("M", bound=BaseModel)

#: The largest JSON request body a route takes unless its `Route.body_limit` says less.
MAX_BODY = 1 << 20
#: Where `endpoint` leaves the route's limit for `read_body` in the ASGI scope.
_LIMIT_KEY = "kibotos.body_limit"


class BodyTooLarge(InvalidArgument):
    """A request body over its route's limit: ``invalid_argument`` as every bad input
    is, with the status that says so (413)."""

    http_status = 413


class UnsupportedMediaType(InvalidArgument):
    """A body that is not of the route's media type (``application/json``, or
    ``application/octet-stream`` for a blob): refused (415) before it is read, so a
    form or a text body is never guessed at."""

    http_status = 415


JSON = "application/json"
OCTET_STREAM = "application/octet-stream"


def declares(request: Request, media_type: str) -> bool:
    """Whether the request says its body is `media_type`; `UnsupportedMediaType` when
    it says it is something else.  No ``Content-Type`` at all is False (allowed for an
    empty JSON body, and for a blob)."""
    declared = request.headers.get("content-type")
    if declared is None:
        return False
    media = declared.partition(";")[0].strip().lower()
    if media != media_type:
        raise UnsupportedMediaType(
            f"request body must be {media_type}, not {declared[:80]!r}",
            details={"content_type": declared[:200]})
    return True


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler | None
    summary: str
    body: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    result: type[BaseModel] | None = None
    #: Who may call it.  Operators, unless the route says otherwise: nearly every route
    #: is theirs, and the default is the narrowest caller but one, never "anyone".
    who: Who = "operator"
    #: The control session: a WebSocket upgrade, served by `SessionHub`, not `handler`.
    websocket: bool = False
    #: The largest JSON body this route reads (`read_body`); small for the routes whose
    #: bodies are small, above all the unauthenticated enrollment exchange.
    body_limit: int = MAX_BODY
    #: The body is bytes (``application/octet-stream``, no limit), streamed by the
    #: handler: an artifact upload.
    bytes_body: bool = False
    #: The result is bytes (``application/octet-stream``, byte ranges allowed), not
    #: ``{"result": ...}``: an artifact download.
    bytes_result: bool = False

    @property
    def operation_id(self) -> str:
        return self.handler.__name__ if self.handler is not None else "node_session"


@dataclass
class Api:
    """What every handler needs: the context, the authenticator and the command journal
    (the live services' own, `Runtime.journal`).  The services a module's handlers act
    through are passed to its ``routes`` beside this."""

    ctx: CtrlContext
    auth: Authenticator
    journal: Journal

    async def journaled(self, operation: str, params: dict[str, Any],
                        body: WriteRequest | None, caller: Caller | None,
                        fn: Txn) -> dict[str, Any]:
        """The result of a write that one journaled transaction does whole, with nothing
        to do after it commits (most writes): `fn` under the body's command ID, the
        caller recorded as who asked."""
        outcome = await self.journal.execute(operation=operation, params=params, body=body,
                                             identity_id=identity_of(caller), fn=fn)
        return outcome.result


def identity_of(caller: Caller | None) -> str | None:
    """The caller's identity ID, as the command journal records who asked (None for a
    route anyone may call)."""
    return caller.identity_id if caller is not None else None


def ok(result: Any) -> JSONResponse:
    return JSONResponse({"result": result})


async def _bounded_bytes(request: Request, limit: int) -> bytes:
    """The body, refused (`BodyTooLarge`) before it is read when its ``Content-Length``
    is over `limit`, and as soon as the bytes streamed (chunked, or more than the
    header said) pass it: no more than `limit` bytes are ever held."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise InvalidArgument(f"Content-Length {declared[:40]!r} is not a decimal number")
        if int(declared) > limit:
            raise BodyTooLarge(f"request body is larger than {limit} bytes",
                               details={"limit": limit})
    chunks: list[bytes] = []
    size = 0
    async with contextlib.aclosing(request.stream()) as stream:
        async for chunk in stream:
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"request body is larger than {limit} bytes",
                                   details={"limit": limit})
            chunks.append(chunk)
    return b"".join(chunks)


async def read_body(request: Request, model: type[M]) -> M:
    """The JSON body as a `model`: bounded by the route's `Route.body_limit`, parsed by
    `kibotos.protocol.json_text` (depth limit, no duplicate keys), an object; an empty
    body is ``{}``.  Every way to be wrong is ``invalid_argument`` (with 413 for a body
    too large, 415 for one that is not ``application/json``)."""
    limit = request.scope.get(_LIMIT_KEY, MAX_BODY)
    declared = declares(request, JSON)
    raw = await _bounded_bytes(request, limit)
    if raw.strip() and not declared:
        raise UnsupportedMediaType("request body has no Content-Type: it must be "
                                   "application/json")
    if not raw.strip():
        data: Any = {}
    else:
        try:
            data = json_text.loads(raw)
        except json_text.JsonTextError as exc:
            raise InvalidArgument(f"request body is not acceptable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument("request body must be a JSON object")
    return model.model_validate(data)


def read_query(request: Request, model: type[M]) -> M:
    """The query string as a `model`; a parameter given twice is refused (``a=1&a=2``
    would otherwise mean whichever one a reader keeps)."""
    items = request.query_params.multi_items()
    seen: set[str] = set()
    for name, _ in items:
        if name in seen:
            raise InvalidArgument(f"query parameter {name[:80]!r} is given more than once",
                                  details={"parameter": name[:200]})
        seen.add(name)
    return model.model_validate(dict(items))


def path_node_id(request: Request) -> str:
    return ids.check_node_id(request.path_params["node_id"])


def path_object_id(key: str, what: str) -> Callable[[Request], str]:
    """The reader of the object ID in path parameter `key` (a Workspace, a Volume):
    the wrong shape is `invalid_argument`, with `what` naming it."""

    def read(request: Request) -> str:
        return ids.check_object_id(request.path_params[key], what)

    return read


path_workspace_id = path_object_id("workspace_id", "workspace ID")


def object_write(name: str, path_id: Callable[[Request], str], body: type[BaseModel],
                 write: ObjectWrite) -> Handler:
    """The handler of a write on the object its path names that one service call does
    whole: the ID (checked before the body is read, so a bad one is refused first), the
    body as `body`, the caller's identity for the journal.  `name` is the handler's
    name, which is the route's OpenAPI operation ID."""

    async def handler(request: Request, caller: Caller | None) -> Any:
        object_id = path_id(request)
        return await write(object_id, await read_body(request, body), identity_of(caller))

    handler.__name__ = name
    return handler


def query_read(name: str, api: Api, query: type[M],
               read: Callable[[M, Session], dict[str, Any]]) -> Handler:
    """The handler of a read the store answers from the query string alone (a list, a
    page of locations): the query as `query`, then ``read(query, session)`` in one
    store transaction.  `name` is the route's OpenAPI operation ID."""

    async def handler(request: Request, caller: Caller | None) -> Any:
        return await api.ctx.store.run(partial(read, read_query(request, query)))

    handler.__name__ = name
    return handler


def waiting_get(name: str, path_id: Callable[[Request], str], query: type[WaitQuery],
                get: Callable[[str, float], Awaitable[dict[str, Any]]]) -> Handler:
    """The handler of a get of the object its path names that may wait (``wait_s`` of
    `query`, a `WaitQuery`) for it to settle: the ID checked first, then
    ``get(id, wait_s)``."""

    async def handler(request: Request, caller: Caller | None) -> Any:
        object_id = path_id(request)
        return await get(object_id, read_query(request, query).wait_s)

    handler.__name__ = name
    return handler


def require_true(value: bool, field: str, asserts: str) -> None:
    """A body field that asserts what ctrl cannot check (the host is off, the data is
    gone) must be given as true: without it the write is `invalid_argument`."""
    if not value:
        raise InvalidArgument(f"{field} must be true: {asserts}", details={"field": field})


def endpoint(api: Api, route: Route) -> Callable[[Request], Awaitable[Response]]:
    """Authenticate as the route's ``who`` says, run the handler, wrap its result."""
    assert route.handler is not None
    handler = route.handler
    check: Callable[[str | None], Awaitable[Caller]] | None = {
        "anyone": None,
        "identity": api.auth.identity,
        "operator": api.auth.operator,
        "node": api.auth.node,
    }[route.who]

    async def run(request: Request) -> Response:
        request.scope[_LIMIT_KEY] = route.body_limit
        caller = None
        if check is not None:
            caller = await check(request.headers.get("authorization"))
        result = await handler(request, caller)
        if isinstance(result, Response):
            return result
        return ok(result)

    run.__name__ = handler.__name__
    return run
