"""The OpenAPI 3.1 document of the ctrl API, built from the route table and its pydantic
models (served at ``GET /v1/openapi.json``).

OpenAPI 3.1 uses JSON Schema 2020-12, which is what pydantic emits, so the model
schemas go into ``components/schemas`` unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kibotos._version import __version__
from kibotos.ctrl.api.routing import Route
from kibotos.ctrl.wire.base import ErrorOut
from kibotos.errors import ERROR_CLASSES

_REF = "#/components/schemas/{model}"
_PATH_PARAM = re.compile(r"{(\w+)}")


def _query_parameters(model: type[BaseModel], defs: dict[str, Any]) -> list[dict[str, Any]]:
    schema = model.model_json_schema(ref_template=_REF)
    defs.update(schema.pop("$defs", {}))
    required = set(schema.get("required", []))
    return [
        {"name": name, "in": "query", "required": name in required, "schema": prop}
        for name, prop in schema.get("properties", {}).items()
    ]


def _security(route: Route) -> list[dict[str, list[str]]]:
    return [] if route.who == "anyone" else [{"bearer": []}]


def build_openapi(routes: Sequence[Route]) -> dict[str, Any]:
    models: list[type[BaseModel]] = [ErrorOut]
    for route in routes:
        models.extend(m for m in (route.body, route.result) if m is not None)
    unique = list(dict.fromkeys(models))
    keyed, top = models_json_schema([(m, "validation") for m in unique], ref_template=_REF)
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    refs = {m: keyed[(m, "validation")] for m in unique}
    error_response = {
        "description": "An error: " + ", ".join(
            f"{code} ({cls.http_status})" for code, cls in ERROR_CLASSES.items()),
        "content": {"application/json": {"schema": refs[ErrorOut]}},
    }
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        op: dict[str, Any] = {
            "operationId": route.operation_id,
            "summary": route.summary,
            "security": _security(route),
            "x-kibotos-caller": route.who,
            "parameters": [
                {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                for name in _PATH_PARAM.findall(route.path)
            ],
        }
        if route.query is not None:
            op["parameters"].extend(_query_parameters(route.query, schemas))
        if route.body is not None:
            op["requestBody"] = {
                "required": False,
                "description": f"At most {route.body_limit} bytes of JSON (no other "
                               "Content-Type; nesting at most 32 deep, no key twice)",
                "content": {"application/json": {"schema": refs[route.body]}},
                "x-kibotos-body-limit": route.body_limit,
            }
        if route.websocket:
            op["description"] = ("WebSocket upgrade; JSON text frames as described in "
                                 "docs/architecture.md, 'Node control session'.")
            op["responses"] = {"101": {"description": "Switching protocols"},
                               "default": error_response}
        else:
            result_schema: dict[str, Any] = (refs[route.result] if route.result is not None
                                             else {})
            op["responses"] = {
                "200": {
                    "description": "Success",
                    "content": {"application/json": {"schema": {
                        "type": "object",
                        "properties": {"result": result_schema},
                        "required": ["result"],
                    }}},
                },
                "default": error_response,
            }
            if route.body is not None:  # refused before the body is read (routing.py)
                op["responses"]["413"] = {**error_response, "description":
                                          f"invalid_argument: body over {route.body_limit} "
                                          "bytes"}
                op["responses"]["415"] = {**error_response, "description":
                                          "invalid_argument: body not application/json"}
        paths.setdefault(route.path, {})[route.method.lower()] = op
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
