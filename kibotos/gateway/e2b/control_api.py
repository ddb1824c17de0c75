"""E2B's control API (``E2B_API_URL``) over the sandbox service, with E2B's status
codes and error bodies, so the SDK raises its own exceptions.

Every route but ``/health`` needs ``X-API-Key``; the key's team is all a call may see.
Routes (E2B's OpenAPI document): ``POST /sandboxes`` and ``/v2/sandboxes`` (201),
``GET /sandboxes`` and ``/v2/sandboxes`` (metadata filter, state, ``limit``,
``nextToken`` → ``X-Next-Token``), ``GET /sandboxes/{id}``, ``DELETE /sandboxes/{id}``
(204), ``POST /sandboxes/{id}/timeout`` (204), ``POST /sandboxes/{id}/connect`` and
``/v2/…/connect`` (200 running, 201 resumed), ``POST /sandboxes/{id}/pause`` (204),
``PUT /sandboxes/{id}/network`` (204).
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kibotos.core.errors import Internal, InvalidArgument, KibotosError, NotFound
from kibotos.gateway.e2b.ctrl_client import Team
from kibotos.gateway.e2b.sandboxes import PAUSED_STATES, RUNNING_STATES, TEAM_LABEL, sandbox_id
from kibotos.gateway.e2b.service import SandboxService
from kibotos.gateway.e2b.wire import (
    ConnectBody,
    NetworkUpdate,
    NewSandbox,
    PauseBody,
    TimeoutBody,
    describe,
    error_response,
)

log = logging.getLogger("kibotos.gateway.e2b")
M = TypeVar("M", bound=BaseModel)
MAX_BODY = 1 << 20
_LIST_PARAMS = {"metadata", "state", "limit", "nextToken", "template", "order"}


async def _body(request: Request, model: type[M]) -> M:
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise InvalidArgument(f"request body is larger than {MAX_BODY} bytes")
    try:
        data = json.loads(raw) if raw.strip() else {}
    except ValueError as exc:
        raise InvalidArgument(f"request body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidArgument(f"invalid request: {describe(exc)}") from None


def _metadata_filter(text: str | None) -> dict[str, str]:
    """E2B's ``metadata`` query: ``k=v&k2=v2`` with each key and value quoted."""
    if not text:
        return {}
    pairs = urllib.parse.parse_qsl(text, keep_blank_values=True, strict_parsing=True)
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def _states(request: Request) -> list[str]:
    asked = [s for v in request.query_params.getlist("state") for s in v.split(",") if s]
    for state in asked:
        if state not in ("running", "paused"):
            raise InvalidArgument(f"state must be running or paused, got {state!r}")
    wanted = asked or ["running", "paused"]
    return [*(RUNNING_STATES if "running" in wanted else ()),
            *(PAUSED_STATES if "paused" in wanted else ())]


def _limit(request: Request) -> int:
    text = request.query_params.get("limit", "100")
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 100:
        raise InvalidArgument(f"limit must be an integer from 1 to 100, got {text!r}")
    return int(text)


def build_control_app(service: SandboxService) -> Starlette:
    Handler = Callable[[Request, Team], Awaitable[Response]]

    def authed(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                team = await service.ctrl.team_of(request.headers.get("x-api-key"))
                return await handler(request, team)
            except KibotosError as exc:
                return error_response(exc)

        return run

    def sid(request: Request) -> str:
        return str(request.path_params["sandbox_id"])

    async def create(request: Request, team: Team) -> Response:
        made = await service.create(team, await _body(request, NewSandbox))
        return JSONResponse(made, status_code=201)

    async def list_sandboxes(request: Request, team: Team) -> Response:
        unknown = sorted(set(request.query_params) - _LIST_PARAMS)
        if unknown:
            raise InvalidArgument(f"unknown query parameter {unknown[0]!r}")
        if request.query_params.get("order", "asc") != "asc":
            raise InvalidArgument("order: only asc (oldest first) is supported")
        wanted = _metadata_filter(request.query_params.get("metadata"))
        template = request.query_params.get("template")
        page = await service.ctrl.workspaces(
            labels={TEAM_LABEL: team.team}, states=_states(request),
            page_size=_limit(request), page_token=request.query_params.get("nextToken"))
        out = []
        for ws in page["workspaces"]:
            record = service.records.get(sandbox_id(ws["workspace_id"]))
            meta = record.metadata if record else {}
            if any(meta.get(k) != v for k, v in wanted.items()):
                continue
            detail = service.detail_json(ws, record)
            if template is not None and detail["templateID"] != template:
                continue
            out.append(detail)
        headers = {"X-Next-Token": page["next_page_token"]} \
            if page.get("next_page_token") else {}
        return JSONResponse(out, headers=headers)

    async def get(request: Request, team: Team) -> Response:
        ws = await service.find(team, sid(request))
        return JSONResponse(service.detail_json(ws, service.records.get(sid(request))))

    async def kill(request: Request, team: Team) -> Response:
        await service.kill(team, sid(request))
        return Response(status_code=204)

    async def set_timeout(request: Request, team: Team) -> Response:
        body = await _body(request, TimeoutBody)
        await service.set_timeout(team, sid(request), body.timeout)
        return Response(status_code=204)

    async def connect(request: Request, team: Team) -> Response:
        body = await _body(request, ConnectBody)
        if body.memory:
            raise InvalidArgument("resuming from a memory snapshot is not supported by "
                                  "this kibotos gateway")
        resumed, made = await service.connect(team, sid(request), body.timeout)
        return JSONResponse(made, status_code=201 if resumed else 200)

    async def pause(request: Request, team: Team) -> Response:
        body = await _body(request, PauseBody)
        await service.pause(team, sid(request), body.memory)
        return Response(status_code=204)

    async def update_network(request: Request, team: Team) -> Response:
        await service.update_network(team, sid(request), await _body(request, NetworkUpdate))
        return Response(status_code=204)

    async def health(request: Request) -> Response:
        return JSONResponse({"message": "ok"})

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return error_response(NotFound(f"no such route: {request.method} "
                                           f"{request.url.path}"))
        return JSONResponse({"code": exc.status_code, "message": str(exc.detail)},
                            status_code=exc.status_code)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(Internal(f"internal error: {type(exc).__name__}"))

    one = "/sandboxes/{sandbox_id}"
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/sandboxes", authed(create), methods=["POST"]),
        Route("/v2/sandboxes", authed(create), methods=["POST"]),
        Route("/sandboxes", authed(list_sandboxes), methods=["GET"]),
        Route("/v2/sandboxes", authed(list_sandboxes), methods=["GET"]),
        Route(one, authed(get), methods=["GET"]),
        Route(one, authed(kill), methods=["DELETE"]),
        Route(f"{one}/timeout", authed(set_timeout), methods=["POST"]),
        Route(f"{one}/connect", authed(connect), methods=["POST"]),
        Route(f"/v2{one}/connect", authed(connect), methods=["POST"]),
        Route(f"{one}/pause", authed(pause), methods=["POST"]),
        Route(f"{one}/network", authed(update_network), methods=["PUT"]),
    ]
    handlers: dict[Any, Any] = {HTTPException: on_http_error, Exception: on_unexpected}
    return Starlette(routes=routes, exception_handlers=handlers)
