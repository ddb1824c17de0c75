"""The OpenAPI 3.1 document of the ctrl API, built from the route table and its pydantic
models (served at ``GET /v1/openapi.json``).

OpenAPI 3.1 uses JSON Schema 2020-12, which is what pydantic emits, so the model
schemas go into ``components/schemas`` unchanged.  The document says what the server
does, because tools (schemathesis in tests/ctrl, generated clients) hold the server to
it: every path parameter has the pattern its check enforces, HEAD is listed wherever
GET is (starlette serves both), blobs are ``application/octet-stream`` both ways, and
each operation lists the errors its shape can give (the API's envelope, with the status
of `kibotos.core.errors`), and ``default`` for the ones its outcome can.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kibotos._version import __version__
from kibotos.core import ids
from kibotos.core.errors import ERROR_CLASSES
from kibotos.ctrl.api.routing import JSON, OCTET_STREAM, Route
from kibotos.ctrl.wire.base import ErrorOut

_REF = "#/components/schemas/{model}"
_PATH_PARAM = re.compile(r"{(\w+)}")

#: Every path parameter of the route table: its shape (the check its handler makes) and
#: what it names.  A route with a parameter not here cannot be documented (KeyError), so
#: a new one gets its pattern when it is added.
PATH_PARAMETERS: dict[str, tuple[re.Pattern[str], str]] = {
    "node_id": (ids.NODE_ID, "A node ID"),
    "workspace_id": (ids.OBJECT_ID, "A Workspace ID (ws-…)"),
    "volume_id": (ids.OBJECT_ID, "A Volume ID (vol-…)"),
    "key_id": (ids.OBJECT_ID, "An API key ID (kak-…)"),
    "pool_id": (ids.POOL_ID, "A storage pool ID"),
    "name": (ids.RESOURCE_NAME, "The name (Template, Egress or Resolver name rule)"),
    "hex": (ids.SHA256_HEX, "The blob's sha256, 64 lowercase hex digits"),
}
#: The error statuses of a handler's outcome (the ``default`` response), by code.
_OUTCOME_CODES = ("failed_precondition", "aborted", "already_exists", "resource_exhausted",
                  "deadline_exceeded", "unavailable")


def _query_parameters(model: type[BaseModel], defs: dict[str, Any]) -> list[dict[str, Any]]:
    schema = model.model_json_schema(ref_template=_REF)
    defs.update(schema.pop("$defs", {}))
    required = set(schema.get("required", []))
    return [
        {"name": name, "in": "query", "required": name in required, "schema": prop}
        for name, prop in schema.get("properties", {}).items()
    ]


def _path_parameters(path: str) -> list[dict[str, Any]]:
    out = []
    for name in _PATH_PARAM.findall(path):
        regex, description = PATH_PARAMETERS[name]
        out.append({"name": name, "in": "path", "required": True, "description": description,
                    "schema": {"type": "string", "pattern": ids.schema_pattern(regex)}})
    return out


def _security(route: Route) -> list[dict[str, list[str]]]:
    return [] if route.who == "anyone" else [{"bearer": []}]


class _Errors:
    """The error responses, all in the envelope (`ErrorOut`)."""

    def __init__(self, error_ref: dict[str, Any]) -> None:
        self.content = {JSON: {"schema": error_ref}}

    def one(self, status: int, text: str, **extra: Any) -> dict[str, Any]:
        return {str(status): {"description": text, "content": self.content, **extra}}

    def of(self, route: Route) -> dict[str, Any]:
        """What the route's shape can answer, before and around its handler."""
        out = self.one(400, "invalid_argument: a path parameter, query parameter, header "
                            "or body that is not acceptable (details.fields names each "
                            "bad field)")
        if route.who != "anyone":
            out |= self.one(401, "unauthenticated: no credential, or one that is "
                                 "malformed, unknown or revoked")
        if route.who in ("operator", "node"):
            out |= self.one(403, f"permission_denied: the identity is not {route.who}'s kind "
                                 "(or may not see this)")
        if _PATH_PARAM.search(route.path):
            out |= self.one(404, "not_found: no such object")
        out |= self.one(405, "invalid_argument: a method the path does not serve",
                        headers={"Allow": {"required": True, "description":
                                           "The methods the path serves",
                                           "schema": {"type": "string"}}})
        if route.body is not None:  # refused before the body is read (routing.py)
            out |= self.one(413, f"invalid_argument: body over {route.body_limit} bytes")
        if route.body is not None or route.bytes_body:
            out |= self.one(415, "invalid_argument: body not "
                                 f"{OCTET_STREAM if route.bytes_body else JSON}")
        if route.bytes_result:
            out |= self.one(416, "invalid_argument: a Range outside the blob",
                            headers={"Content-Range": {"required": True,
                                                       "schema": {"type": "string"}}})
        out |= self.one(500, "internal: ctrl could not answer (the details are in its log)")
        out["default"] = {"description": "An error of the request's outcome: " + ", ".join(
            f"{code} ({ERROR_CLASSES[code].http_status})" for code in _OUTCOME_CODES),
            "content": self.content}
        return out


def _success(route: Route, refs: dict[type[BaseModel], Any]) -> dict[str, Any]:
    if route.bytes_result:
        blob = {OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}}
        return {"200": {"description": "The blob", "content": blob},
                "206": {"description": "The requested byte range of the blob",
                        "content": blob, "headers": {"Content-Range": {
                            "required": True, "schema": {"type": "string"}}}}}
    if route.websocket:
        return {"101": {"description": "Switching protocols"},
                "426": {"description": "invalid_argument: a request that is not a "
                                       "WebSocket upgrade", "headers": {"Upgrade": {
                                           "required": True, "schema": {"type": "string"}}}}}
    result_schema: dict[str, Any] = refs[route.result] if route.result is not None else {}
    return {"200": {"description": "Success", "content": {JSON: {"schema": {
        "type": "object", "properties": {"result": result_schema}, "required": ["result"],
    }}}}}


def _request_body(route: Route, refs: dict[type[BaseModel], Any]) -> dict[str, Any] | None:
    if route.bytes_body:
        return {"required": True, "description": "The blob's bytes (any size, streamed)",
                "content": {OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}}}
    if route.body is None:
        return None
    # An absent body is read as {}: optional unless the model has a required field.
    needed = bool(route.body.model_json_schema().get("required"))
    return {"required": needed,
            "description": f"At most {route.body_limit} bytes of JSON (no other "
                           "Content-Type; nesting at most 32 deep, no key twice; none "
                           "at all is {})",
            "content": {JSON: {"schema": refs[route.body]}},
            "x-kibotos-body-limit": route.body_limit}


def _head(get: dict[str, Any]) -> dict[str, Any]:
    """The HEAD operation of a GET one: the same answers, headers only."""
    responses = {status: {k: v for k, v in answer.items() if k != "content"}
                 for status, answer in get["responses"].items()}
    return {**get, "operationId": get["operationId"] + "_head",
            "summary": "Headers of: " + get["summary"], "responses": responses}


def build_openapi(routes: Sequence[Route]) -> dict[str, Any]:
    models: list[type[BaseModel]] = [ErrorOut]
    for route in routes:
        models.extend(m for m in (route.body, route.result) if m is not None)
    unique = list(dict.fromkeys(models))
    keyed, top = models_json_schema([(m, "validation") for m in unique], ref_template=_REF)
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    refs = {m: keyed[(m, "validation")] for m in unique}
    errors = _Errors(refs[ErrorOut])
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        op: dict[str, Any] = {
            "operationId": route.operation_id,
            "summary": route.summary,
            "security": _security(route),
            "x-kibotos-caller": route.who,
            "parameters": _path_parameters(route.path),
        }
        if route.query is not None:
            op["parameters"].extend(_query_parameters(route.query, schemas))
        body = _request_body(route, refs)
        if body is not None:
            op["requestBody"] = body
        if route.websocket:
            op["description"] = ("WebSocket upgrade; JSON text frames as described in "
                                 "docs/architecture.md, 'Node control session'.")
        op["responses"] = _success(route, refs) | errors.of(route)
        methods = paths.setdefault(route.path, {})
        methods[route.method.lower()] = op
        if route.method == "GET":
            methods["head"] = _head(op)
    return {
        "openapi": "3.1.0",
        "info": {"title": "kibotos ctrl API", "version": __version__},
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "<identity_id>:<secret>, from POST /v1/enrollment/exchange",
            }},
        },
    }
