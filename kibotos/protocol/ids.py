"""The identifier shapes of `kibotos.ids` as pydantic field types.

Every model that carries an ID (the session's messages, the node commands' arguments,
ctrl's HTTP requests, the configuration files) declares the field with one of these, so
an ID has one rule, written once in `kibotos.ids`, and a bad one is reported the same
way everywhere: pydantic names the field, the message says what the shape must be.
The types are strict: a number where an ID belongs is refused, not turned into text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from pydantic import AfterValidator, StrictStr

from kibotos import ids
from kibotos.errors import InvalidArgument


def as_validator(check: Callable[[str], str]) -> AfterValidator:
    """`check` (one of `kibotos.ids`' checks, raising `InvalidArgument`) as a pydantic
    validator: the `ValueError` pydantic turns into a message naming the field."""

    def validate(value: str) -> str:
        try:
            return check(value)
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None

    validate.__name__ = getattr(check, "__name__", "check")
    return AfterValidator(validate)


def _object_id(kind: str) -> AfterValidator:
    return as_validator(lambda value: ids.check_object_id(value, kind))


#: Volume IDs, retained-layer refs, Instance and Workspace IDs: 1-32 bytes of lowercase
#: letters, digits and hyphens, not starting with a hyphen (they become file names).
ObjectId = Annotated[StrictStr, _object_id("object ID")]
InstanceId = Annotated[StrictStr, _object_id("instance ID")]
WorkspaceId = Annotated[StrictStr, _object_id("workspace ID")]
VolumeId = Annotated[StrictStr, _object_id("volume ID")]
LayerRefId = Annotated[StrictStr, _object_id("retained layer ref")]
#: A DNS label: node IDs name units, files and hosts.
NodeId = Annotated[StrictStr, as_validator(ids.check_node_id)]
PoolId = Annotated[StrictStr, as_validator(ids.check_pool_id)]
TemplateName = Annotated[StrictStr, as_validator(ids.check_template_name)]
CommandId = Annotated[StrictStr, as_validator(ids.check_command_id)]
LabelKey = Annotated[StrictStr, as_validator(ids.check_label_key)]
#: An artifact digest, kept in its canonical form ``sha256:<hex>`` (the bare 64 hex
#: digits are accepted on input and gain the prefix).
Digest = Annotated[StrictStr, as_validator(ids.check_digest)]
#: ``welcome.session_id`` (``ses-…``, `kibotos.ids.new_id`).
SessionId = Annotated[StrictStr, _object_id("session ID")]
