"""The identifier shapes of `kibotos.core.ids` as pydantic field types.

Every model that carries an ID (the session's messages, the node commands' arguments,
ctrl's HTTP requests, the configuration files) declares the field with one of these, so
an ID has one rule, written once in `kibotos.core.ids`, and a bad one is reported the same
way everywhere: pydantic names the field, the message says what the shape must be.
The types are strict: a number where an ID belongs is refused, not turned into text.
Each also states its rule as a JSON Schema ``pattern`` (`SchemaPattern`), so ctrl's
OpenAPI document gives every ID field the shape the check enforces.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, GetJsonSchemaHandler, StrictStr
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from kibotos.core import ids
from kibotos.core.errors import InvalidArgument


def as_validator(check: Callable[[str], str]) -> AfterValidator:
    """`check` (one of `kibotos.core.ids`' checks, raising `InvalidArgument`) as a pydantic
    validator: the `ValueError` pydantic turns into a message naming the field."""

    def validate(value: str) -> str:
        try:
            return check(value)
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None

    validate.__name__ = getattr(check, "__name__", "check")
    return AfterValidator(validate)


@dataclass(frozen=True)
class SchemaPattern:
    """Field metadata that adds `regex` (one of `kibotos.core.ids`' shapes) to the field's
    JSON schema as its ``pattern``.  Only the schema: the check stays the validator's,
    whose message says the rule in words (a pydantic ``pattern`` would check twice and
    answer with the bare expression)."""

    regex: re.Pattern[str]

    def __get_pydantic_json_schema__(self, core_schema: CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        schema: dict[str, Any] = handler(core_schema)
        schema["pattern"] = ids.schema_pattern(self.regex)
        return schema


def _object_id(kind: str) -> AfterValidator:
    return as_validator(lambda value: ids.check_object_id(value, kind))


_OBJECT = SchemaPattern(ids.OBJECT_ID)
#: The schema of every name kept by the Template name rule (`kibotos.core.ids.check_resource_name`).
RESOURCE_NAME_PATTERN = SchemaPattern(ids.RESOURCE_NAME)

#: Volume IDs, retained-layer refs, Instance and Workspace IDs: 1-32 bytes of lowercase
#: letters, digits and hyphens, not starting with a hyphen (they become file names).
ObjectId = Annotated[StrictStr, _object_id("object ID"), _OBJECT]
InstanceId = Annotated[StrictStr, _object_id("instance ID"), _OBJECT]
WorkspaceId = Annotated[StrictStr, _object_id("workspace ID"), _OBJECT]
VolumeId = Annotated[StrictStr, _object_id("volume ID"), _OBJECT]
LayerRefId = Annotated[StrictStr, _object_id("retained layer ref"), _OBJECT]
#: A DNS label: node IDs name units, files and hosts.
NodeId = Annotated[StrictStr, as_validator(ids.check_node_id), SchemaPattern(ids.NODE_ID)]
PoolId = Annotated[StrictStr, as_validator(ids.check_pool_id), SchemaPattern(ids.POOL_ID)]
TemplateName = Annotated[StrictStr, as_validator(ids.check_template_name),
                         RESOURCE_NAME_PATTERN]
CommandId = Annotated[StrictStr, as_validator(ids.check_command_id),
                      SchemaPattern(ids.COMMAND_ID)]
LabelKey = Annotated[StrictStr, as_validator(ids.check_label_key), SchemaPattern(ids.LABEL_KEY)]
#: An artifact digest, kept in its canonical form ``sha256:<hex>`` (the bare 64 hex
#: digits are accepted on input and gain the prefix).
Digest = Annotated[StrictStr, as_validator(ids.check_digest), SchemaPattern(ids.DIGEST)]
#: ``welcome.session_id`` (``ses-…``, `kibotos.core.ids.new_id`).
SessionId = Annotated[StrictStr, _object_id("session ID"), _OBJECT]
