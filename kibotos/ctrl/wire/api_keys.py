"""Request and result shapes of the API keys (``/v1/api-keys``, docs/gateways.md).

A key is ``<key_id>.<secret>``; the secret is shown once, in `ApiKeyCreateOut`, and
nowhere else: no list, get or journal entry carries it.  Names and teams follow the
Template name rule (they are shown in tables and become Workspace labels).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StrictStr

from kibotos.core import ids
from kibotos.ctrl.wire.base import Request, Result, WriteRequest
from kibotos.protocol.ids import RESOURCE_NAME_PATTERN, as_validator

STRICT = ConfigDict(extra="forbid", frozen=True, strict=True)

KeyName = Annotated[StrictStr, as_validator(lambda v: ids.check_resource_name(v, "key name")),
                    RESOURCE_NAME_PATTERN]
TeamName = Annotated[StrictStr, as_validator(lambda v: ids.check_resource_name(v, "team")),
                     RESOURCE_NAME_PATTERN]


class ApiKeyCreateIn(WriteRequest):
    model_config = STRICT

    name: KeyName
    team: TeamName = "default"


class ApiKeyRevokeIn(WriteRequest):
    model_config = STRICT


class ApiKeyVerifyIn(Request):
    """What a gateway sends to learn whose key its caller presented."""

    model_config = STRICT

    key: StrictStr = Field(min_length=1, max_length=200)


class ApiKeyOut(Result):
    key_id: str
    name: str
    team: str
    state: Literal["active", "revoked"]
    created_at: str
    created_by: str | None
    revoked_at: str | None


class ApiKeyCreateOut(ApiKeyOut):
    #: The whole key, shown this once.
    key: str


class ApiKeyListOut(Result):
    api_keys: list[ApiKeyOut]


class ApiKeyVerifyOut(Result):
    key_id: str
    name: str
    team: str
