"""Messages of the node control session (docs/architecture.md, "Node control session").

Every frame is one JSON object whose ``type`` names the message, its fields beside it.
Node messages are validated here; unknown extra fields are ignored so a newer node can
add facts without breaking an older ctrl, but a known field of the wrong type is a
protocol error.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kibotos import ids
from kibotos.ctrl.wire.base import parse_time
from kibotos.errors import InvalidArgument

#: ``rejected.reason`` values.  A retired node is told ``not_admitted`` (or ``isolated``
#: while it still uses the isolated incarnation), as spec/nodes.txt says.
REJECT_REASONS = ("isolated", "not_admitted", "stale_incarnation", "invalid_hello")


class _Msg(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


_M = TypeVar("_M", bound=_Msg)


def _check_time(value: str | None, what: str) -> str | None:
    try:
        parse_time(value, what)
    except InvalidArgument as exc:
        raise ValueError(exc.message) from None
    return value


class Amount(_Msg):
    cpu_millis: int = Field(ge=0)
    memory_bytes: int = Field(ge=0)


class ReportFields(_Msg):
    allocated: Amount = Field(default_factory=lambda: Amount(cpu_millis=0, memory_bytes=0))
    instance_count: int = Field(default=0, ge=0)
    volume_count: int = Field(default=0, ge=0)
    memory_tight: bool = False
    memory_tight_since: str | None = None
    #: Every Instance on the node ``{instance_id, workspace_id, state, reason}``, so
    #: ctrl reconciles after a reconnect; None from a node that does not say.
    instances: list[dict[str, Any]] | None = None
    #: In a ``report``: the facts that change while a session lives (``pools`` with
    #: their availability); stored over hello's.  None from a node that does not say.
    facts: dict[str, Any] | None = None

    @field_validator("memory_tight_since")
    @classmethod
    def _since(cls, v: str | None) -> str | None:
        return _check_time(v, "memory_tight_since")


class Report(ReportFields):
    type: Literal["report"]


class Hello(_Msg):
    type: Literal["hello"]
    node_id: str
    incarnation: int = Field(ge=1)
    release_version: str | None = Field(default=None, max_length=64)
    source_revision: str | None = Field(default=None, max_length=64)
    resources: Amount
    report: ReportFields = Field(default_factory=ReportFields)
    dataplane_address: str | None = Field(default=None, max_length=255)
    facts: dict[str, Any] = Field(default_factory=dict)

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, v: str) -> str:
        try:
            return ids.check_node_id(v)
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None


class InstanceState(_Msg):
    """node → ctrl whenever an Instance changes state (docs/architecture.md)."""

    type: Literal["instance_state"]
    instance_id: str = Field(min_length=1, max_length=40)
    workspace_id: str | None = Field(default=None, max_length=40)
    state: Literal["CREATING", "RUNNING", "STOPPING", "STOPPED", "FAILED", "DESTROYED"]
    reason: str | None = Field(default=None, max_length=4000)
    guest: dict[str, Any] | None = None
    #: A stuck release (STOPPING): ``{pending_since, held: [{item, part}]}``.
    cleanup: dict[str, Any] | None = None
    #: What it opened: ``[{kind, pool_id, object_id, epoch, released_cleanly}]``.
    objects: list[dict[str, Any]] | None = None
    at: str | None = None

    @field_validator("at")
    @classmethod
    def _at(cls, v: str | None) -> str | None:
        return _check_time(v, "at")


class ClockReply(_Msg):
    type: Literal["clock_reply"]
    id: int
    node_time: float
    sync_status: str = Field(default="unknown", max_length=32)


class Usage(_Msg):
    type: Literal["usage"]
    id: int
    sample: dict[str, Any] | None


class CommandResult(_Msg):
    type: Literal["command_result"]
    id: int
    ok: bool
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class OvercommitAck(_Msg):
    type: Literal["overcommit_ack"]
    serial: int = Field(ge=0)


class ProtocolError(Exception):
    """A frame that is not a valid message; the session is closed with its text."""


def describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "message"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def decode(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ProtocolError("frame is not a JSON object with a string 'type'")
    return data


def parse(model: type[_M], data: dict[str, Any]) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ProtocolError(f"invalid {data.get('type')} message: {describe(exc)}") from None


def encode(message: dict[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":"))
