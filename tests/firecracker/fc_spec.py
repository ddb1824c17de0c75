"""Firecracker's OpenAPI document (``swagger/firecracker.yaml``) as a request validator.

Used by the stand-in (`fc_standin`): every request is matched to an operation of the
document by method and path template, and its body validated against the operation's
body schema (JSON Schema draft 4 is what Swagger 2.0 schemas are).  Two rules come from
Firecracker's behaviour rather than the document's text, and are applied here too:

* unknown fields are refused: every configuration struct in Firecracker is
  ``#[serde(deny_unknown_fields)]``, so each object schema that does not say otherwise
  gets ``additionalProperties: false``;
* an operation whose summary says "Pre-boot only" (or whose description says it fails
  "after machine startup") is refused once the microVM started, and one that says
  "Post-boot only" before; the document states these, the stand-in enforces them.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SWAGGER = Path(__file__).with_name("swagger") / "firecracker.yaml"
_METHODS = ("get", "put", "patch", "delete")


class Refused(Exception):
    """A request Firecracker would answer with an error: status and fault message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Operation:
    method: str
    template: str
    operation_id: str
    path_params: tuple[str, ...]
    regex: re.Pattern[str]
    body_schema: dict[str, Any] | None
    body_required: bool
    pre_boot: bool
    post_boot: bool


def _strict(node: Any) -> Any:
    """Add ``additionalProperties: false`` to object schemas that list properties and
    say nothing of extra ones (Firecracker's deny_unknown_fields)."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if out.get("type") == "object" and "properties" in out \
                and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


def _template_regex(template: str) -> tuple[re.Pattern[str], tuple[str, ...]]:
    params = tuple(re.findall(r"\{([a-z_]+)\}", template))
    pattern = re.sub(r"\\\{([a-z_]+)\\\}", r"(?P<\1>[^/]*)", re.escape(template))
    return re.compile(f"^{pattern}$"), params


class ApiDocument:
    """The operations of the document, and validation of one request against them."""

    def __init__(self, path: Path = SWAGGER) -> None:
        doc = yaml.safe_load(path.read_text())
        if doc.get("swagger") != "2.0":
            raise ValueError(f"{path} is not a Swagger 2.0 document")
        self.version = str(doc["info"]["version"])
        self.definitions = _strict(doc["definitions"])
        self.raw_definitions = doc["definitions"]
        self.operations: list[Operation] = []
        for template, item in doc["paths"].items():
            regex, params = _template_regex(template)
            for method in _METHODS:
                op = item.get(method)
                if op is None:
                    continue
                body = next((p for p in op.get("parameters", []) if p.get("in") == "body"),
                            None)
                text = f"{op.get('summary', '')} {op.get('description', '')}"
                self.operations.append(Operation(
                    method=method.upper(), template=template,
                    operation_id=op["operationId"], path_params=params, regex=regex,
                    body_schema=body["schema"] if body else None,
                    body_required=bool(body and body.get("required")),
                    pre_boot="Pre-boot only" in text or "fail after machine startup" in text,
                    post_boot="Post-boot only" in text,
                ))

    def operation(self, operation_id: str) -> Operation:
        return next(op for op in self.operations if op.operation_id == operation_id)

    def find(self, method: str, path: str) -> tuple[Operation, dict[str, str]]:
        """The operation `method` `path` names, and its path parameters."""
        for op in self.operations:
            m = op.regex.match(path)
            if m and op.method == method:
                return op, m.groupdict()
        raise Refused(400, f"Invalid request method and/or path: {method} {path}.")

    def validator(self, schema: dict[str, Any]) -> jsonschema.Draft4Validator:
        full = {**copy.deepcopy(schema), "definitions": self.definitions}
        return jsonschema.Draft4Validator(full)

    def validate(self, op: Operation, raw: bytes) -> Any:
        """The decoded body of a request for `op`, or Refused as Firecracker words it."""
        if not raw:
            if op.method in ("PUT", "PATCH") and op.body_schema is not None:
                raise Refused(400, f"Empty {op.method} request.")
            return None
        if op.method == "GET":
            raise Refused(400, "GET request cannot have a body.")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise Refused(400, "An error occurred when deserializing the json body of a "
                               f"request: {exc}.") from None
        if op.body_schema is None:
            raise Refused(400, f"{op.method} {op.template} takes no body.")
        errors = sorted(self.validator(op.body_schema).iter_errors(body),
                        key=lambda e: list(e.absolute_path))
        if errors:
            first = errors[0]
            where = "/".join(str(p) for p in first.absolute_path) or "body"
            raise Refused(400, "An error occurred when deserializing the json body of a "
                               f"request: {where}: {first.message}.")
        return body


def checked_id(value: str) -> str:
    """Firecracker's rule for resource IDs in paths: not empty, letters, digits, '_'."""
    if not value:
        raise Refused(400, "The ID cannot be empty.")
    if not all(c == "_" or c.isalnum() for c in value):
        raise Refused(400, "API Resource IDs can only contain alphanumeric characters and "
                           "underscores.")
    return value
