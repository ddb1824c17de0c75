"""The route table every API module contributes to, and what each handler shares.

A `Route` names its method, path, handler and summary, who may call it (operators
unless it says otherwise), and its body, query and result models.  `app.py` turns the
table into Starlette routes, and `openapi.py` into the OpenAPI document, so the two
cannot disagree.  The ``who`` column is enforced here, in one wrapper, before a handler
runs: a handler never forgets to authenticate.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kibotos import ids
from kibotos.ctrl.api.auth import Authenticator, Caller
from kibotos.ctrl.live.context import CtrlContext
from kibotos.ctrl.store.journal import Journal, Txn
from kibotos.ctrl.wire.base import WriteRequest
from kibotos.errors import InvalidArgument

#: The service call a plain write on one object is: its ID, the checked body, and the
#: caller's identity for the journal.
ObjectWrite = Callable[[str, Any, str | None], Awaitable[Any]]

Who = Literal["anyone", "identity", "operator", "node"]
Handler = Callable[[Request, Caller | None], Awaitable[Any]]
M = TypeVar("M", bound=BaseModel)

MAX_BODY = 1 << 20


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


async def read_body(request: Request, model: type[M]) -> M:
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise InvalidArgument(f"request body is larger than {MAX_BODY} bytes")
    if not raw.strip():
        data: Any = {}
    else:
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise InvalidArgument(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument("request body must be a JSON object")
    return model.model_validate(data)


def read_query(request: Request, model: type[M]) -> M:
    return model.model_validate(dict(request.query_params))


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
        caller = None
        if check is not None:
            caller = await check(request.headers.get("authorization"))
        result = await handler(request, caller)
        if isinstance(result, Response):
            return result
        return ok(result)

    run.__name__ = handler.__name__
    return run
