"""The ctrl ASGI application: the route table of every API module, one error mapping.

The app is built on ctrl's live services (`CtrlServices`, built once by
`kibotos.ctrl.serve.build_services`): each route module gets the services its handlers
act through, and none builds one of its own.

Errors leave in one shape, ``{"error": {"code", "message", "details"?}}``, with the HTTP
status of `kibotos.core.errors`: a `KibotosError` as it is, a pydantic validation error as
``invalid_argument`` naming the bad field, an unknown route as ``not_found``, anything
else as ``internal`` (and logged).  Tests drive this app in-process through
``httpx.ASGITransport``; `serve.py` serves it with hypercorn.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match, WebSocketRoute
from starlette.routing import Route as StarletteRoute
from starlette.websockets import WebSocket

from kibotos.core.control_chars import CONTROL_CHARACTERS
from kibotos.core.errors import Internal, InvalidArgument, KibotosError, NotFound
from kibotos.ctrl.api import enrollment as api_enrollment
from kibotos.ctrl.api import network as api_network
from kibotos.ctrl.api import nodes as api_nodes
from kibotos.ctrl.api import pools as api_pools
from kibotos.ctrl.api import sessions as api_sessions
from kibotos.ctrl.api import templates as api_templates
from kibotos.ctrl.api import transfers as api_transfers
from kibotos.ctrl.api import volumes as api_volumes
from kibotos.ctrl.api import workspaces as api_workspaces
from kibotos.ctrl.api.auth import Authenticator, Caller
from kibotos.ctrl.api.cluster_metrics import install as install_metrics
from kibotos.ctrl.api.metrics import RequestMetrics
from kibotos.ctrl.api.openapi import build_openapi
from kibotos.ctrl.api.routing import Api, BodyTooLarge, Route, endpoint
from kibotos.ctrl.live.node_sessions import SessionHub
from kibotos.ctrl.live.services import CtrlServices

log = logging.getLogger("kibotos.ctrl.api.app")


def describe_validation(exc: ValidationError) -> InvalidArgument:
    """One message naming every bad field, e.g. ``expected_version: Input should be a
    valid integer``; the same list, structured, in ``details.fields``."""
    fields = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        msg = str(err["msg"]).removeprefix("Value error, ")
        fields.append({"field": loc, "message": msg})
    text = "; ".join(f"{f['field']}: {f['message']}" for f in fields)
    return InvalidArgument(f"invalid request: {text}", details={"fields": fields})


def _error(exc: KibotosError, status: int | None = None) -> JSONResponse:
    return JSONResponse(exc.to_wire(), status_code=status or exc.http_status)


async def _on_kibotos_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, KibotosError)
    response = _error(exc)
    if isinstance(exc, BodyTooLarge):
        # The rest of the body is never read: the connection cannot carry another
        # request, and closing it ends the client's upload instead of stalling it.
        response.headers["Connection"] = "close"
    return response


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ValidationError)
    return _error(describe_validation(exc))


def _allowed(request: Request) -> list[str]:
    """The methods the API serves on the request's path (HEAD where GET is), for the
    ``Allow`` header of a 405: every route of the path, not just the first matched."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if not isinstance(route, StarletteRoute):
            continue
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match is not Match.NONE:
            methods.update(route.methods or ())
    return sorted(methods)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    path = printable_path(request)
    if exc.status_code == 404:
        return _error(NotFound(f"no such API route: {request.method} {path}"))
    if exc.status_code == 405:
        allowed = _allowed(request)
        response = _error(InvalidArgument(
            f"method {request.method} is not allowed on {path} (allowed: "
            f"{', '.join(allowed)})", details={"allowed": allowed}), 405)
        response.headers["Allow"] = ", ".join(allowed)
        return response
    return _error(InvalidArgument(str(exc.detail)), exc.status_code)


def printable_path(request: Request) -> str:
    """The request path for a message: bounded, and without the control characters a
    percent-encoded path can carry."""
    return CONTROL_CHARACTERS.sub("?", request.url.path[:200])


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    # The exception goes to the log only: its class, text and traceback describe
    # ctrl's insides, which are no business of the caller.
    log.exception("unexpected error in %s %s", request.method, request.url.path)
    return _error(Internal("internal error: ctrl could not answer this request; the "
                           "details are in ctrl's log"))


class UpgradeRequired(InvalidArgument):
    """A plain HTTP request to the WebSocket endpoint: the path is served, by upgrade
    only (426 says so, where a 404 would say there is no such route)."""

    http_status = 426


async def _upgrade_required(request: Request) -> Response:
    response = _error(UpgradeRequired(
        f"{printable_path(request)} is a WebSocket endpoint: upgrade the connection"))
    response.headers["Upgrade"] = "websocket"
    return response


def api_routes(api: Api, services: CtrlServices) -> list[Route]:
    """The whole HTTP API, as a table (the OpenAPI document is built from it)."""
    table: list[Route] = []

    async def openapi(request: Request, caller: Caller | None) -> Response:
        return JSONResponse(document)

    table.extend(api_enrollment.routes(api))
    table.extend(api_nodes.routes(api))
    table.extend(api_templates.routes(api, services.artifacts))
    table.extend(api_workspaces.routes(api, services.workspaces, services.runtime))
    table.extend(api_network.routes(api, services.workspaces))
    table.extend(api_sessions.routes(api))
    table.extend(api_volumes.routes(api, services.volumes, services.objects))
    table.extend(api_transfers.routes(services.transfers))
    table.extend(api_pools.routes(api))
    table.append(Route("GET", "/v1/node/session", None, "The node control session (WebSocket)",
                       websocket=True, who="node"))
    table.append(Route("GET", "/v1/openapi.json", openapi, "This OpenAPI document", who="anyone"))
    document: dict[str, Any] = build_openapi(table)
    return table


def build_app(services: CtrlServices) -> Starlette:
    ctx = services.ctx
    if not isinstance(ctx.sessions, SessionHub):
        raise TypeError("build_app needs ctx.sessions to be a "
                        "kibotos.ctrl.live.node_sessions.SessionHub")
    hub = ctx.sessions
    auth = Authenticator(ctx.store)
    api = Api(ctx=ctx, auth=auth, journal=services.runtime.journal)

    async def node_session(ws: WebSocket) -> None:
        await hub.serve_websocket(ws, auth)

    starlette_routes: list[BaseRoute] = []
    table = api_routes(api, services)
    for route in table:
        if route.websocket:
            starlette_routes.append(WebSocketRoute(route.path, node_session))
            starlette_routes.append(StarletteRoute(route.path, _upgrade_required,
                                                   methods=[route.method]))
        else:
            starlette_routes.append(StarletteRoute(route.path, endpoint(api, route),
                                                   methods=[route.method]))
    middleware: list[Middleware] = []
    if ctx.config.metrics.enabled:  # Prometheus text, outside /v1 (docs/metrics.md)
        starlette_routes.append(StarletteRoute(
            "/metrics", install_metrics(ctx, services.runtime.index, auth.operator),
            methods=["GET"]))
        middleware.append(Middleware(RequestMetrics, metrics=ctx.metrics))
    app = Starlette(
        routes=starlette_routes,
        middleware=middleware,
        exception_handlers={
            KibotosError: _on_kibotos_error,
            ValidationError: _on_validation_error,
            HTTPException: _on_http_error,
            Exception: _on_unexpected,
        },
    )
    # One canonical path per route: ``/v1/nodes/`` is not found, not a 307 to
    # ``/v1/nodes`` (which PUT and DELETE clients would follow without their body).
    app.router.redirect_slashes = False
    app.state.ctx = ctx
    app.state.services = services
    app.state.api = api
    app.state.routes = table
    return app
