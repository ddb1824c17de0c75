"""The HTTP API's request and result shapes, and the time format used on the wire.

Request models forbid unknown fields, so a misspelt key is an `invalid_argument` naming
it instead of a silently ignored option.  Bodies are strict (pydantic's strict mode):
``true`` is not 1, ``"1"`` is not 1, a capacity sent as a string is refused, because a
lax reading turned ``"cpu_millis": true`` into a 0.001-CPU Workspace.  Every integer
has a ceiling, so nothing reaches the store that SQLite cannot hold.  Query strings
are text by nature: `Query` reads their numbers as `kibotos.core.units` does (ASCII digits
only) and their booleans as ``true`` or ``false``.  Values that have a documented shape (IDs,
ratios, command IDs) are checked here, before the command journal sees the request:
bad input writes nothing, not even a journal row.  Result models describe what the
handlers return; the OpenAPI document is built from them, and the tests validate real
responses against them so the two cannot drift apart.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from types import NoneType, UnionType
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator, model_validator

from kibotos.core import units
from kibotos.core.errors import InvalidArgument
from kibotos.protocol.ids import CommandId, Digest, NodeId
from kibotos.protocol.values import MAX_COUNTER, Printable, parse_rfc3339

# ----------------------------------------------------------------------------- time


def as_utc(value: datetime) -> datetime:
    """SQLite hands back naive datetimes for timezone-aware columns; they are UTC."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def iso(value: datetime | None) -> str | None:
    """RFC 3339 UTC with a ``Z``, millisecond precision: the one time format on the wire."""
    if value is None:
        return None
    if value.tzinfo is not None:
        value = value.astimezone(UTC).replace(tzinfo=None)
    return value.isoformat(timespec="milliseconds") + "Z"


def parse_time(value: object, what: str) -> datetime | None:
    """Read an RFC 3339 time sent by a node (``None`` stays ``None``)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be an RFC 3339 time string, got {value!r}")
    try:
        parsed = parse_rfc3339(value)
    except ValueError as exc:
        raise InvalidArgument(f"{what} {exc}: {value!r}") from None
    return as_utc(parsed)


# ------------------------------------------------------------------------- requests


def _as_value_error(fn: Any, value: Any) -> Any:
    try:
        return fn(value)
    except InvalidArgument as exc:
        raise ValueError(exc.message) from None


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _scalar(annotation: Any) -> Any:
    """``int`` of ``int | None`` (a query field's one scalar type), else `annotation`."""
    if get_origin(annotation) in (Union, UnionType):
        kinds = [a for a in get_args(annotation) if a is not NoneType]
        if len(kinds) == 1:
            return _scalar(kinds[0])
    return annotation


class Query(Request):
    """A query string's parameters: text, read strictly by hand (integers in ASCII
    digits, other numbers in JSON's syntax, booleans ``true``/``false``), then checked
    laxly by pydantic, which would otherwise take ``1_0``, `` 5 ``, ``+5`` and ``yes``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if field is None or not isinstance(value, str):
                continue
            kind = _scalar(field.annotation)
            try:
                if kind is bool and value not in ("true", "false"):
                    raise InvalidArgument(f"{name} must be true or false")
                if kind is int:
                    units.parse_int(value, name)
                elif kind is float:
                    units.parse_json_number(value, name)
            except InvalidArgument as exc:
                raise ValueError(exc.message) from None
        return data


class WaitQuery(Query):
    """The query of a get that may wait for its object to settle (a Workspace, a
    Volume): ``wait_s``, up to a minute."""

    #: Wait up to this long for a settled state (no operation running).
    wait_s: float = Field(default=0.0, ge=0.0, le=60.0)


class WriteRequest(Request):
    """Every write may carry a command ID; replaying it returns the stored result."""

    command_id: CommandId | None = None


class VersionedWrite(WriteRequest):
    """A write to a versioned record: a stale `expected_version` is refused (aborted)."""

    expected_version: int | None = Field(default=None, ge=0, le=MAX_COUNTER)


class ExchangeIn(Request):
    token: Printable = Field(min_length=1, max_length=200)
    #: Base64 or PEM (whose lines end in newlines); it must parse as a key anyway.
    public_key: StrictStr = Field(min_length=1, max_length=1000)


class GrantCreateIn(WriteRequest):
    kind: Literal["node", "operator"]
    node_id: NodeId | None = None
    #: Shown in `kibo enrollment list`: printable, so it cannot paint a terminal.
    name: Printable | None = Field(default=None, min_length=1, max_length=128)
    expires_in_s: float | None = Field(default=None, gt=0, le=366 * 86400)

    @model_validator(mode="after")
    def _kind_node(self) -> GrantCreateIn:
        if self.kind == "node" and self.node_id is None:
            raise ValueError("node_id is required for a node grant")
        if self.kind == "operator" and self.node_id is not None:
            raise ValueError("node_id must not be given for an operator grant")
        return self


class RevokeIn(WriteRequest):
    id: Printable = Field(min_length=1, max_length=40)


class IsolateIn(VersionedWrite):
    confirm_host_cannot_write: bool = False


def _ratio(value: str | None, what: str, allow_default: bool) -> str | None:
    if value is None or (allow_default and value == "default"):
        return value
    units.parse_ratio(value, what)
    return value


class _OvercommitIn(VersionedWrite):
    """Ratios to change; the item not given keeps its value.  `ALLOW_DEFAULT` says
    whether ``"default"`` (drop a node's override) is a value here."""

    ALLOW_DEFAULT: ClassVar[bool] = False
    cpu: str | None = None
    memory: str | None = None

    @field_validator("cpu", "memory")
    @classmethod
    def _check(cls, v: str | None, info: Any) -> str | None:
        checked: str | None = _as_value_error(
            lambda x: _ratio(x, f"{info.field_name} ratio", cls.ALLOW_DEFAULT), v)
        return checked

    @model_validator(mode="after")
    def _something(self) -> _OvercommitIn:
        if self.cpu is None and self.memory is None:
            raise ValueError("give cpu, memory or both")
        return self


class OvercommitDefaultIn(_OvercommitIn):
    ALLOW_DEFAULT = False


class OvercommitNodeIn(_OvercommitIn):
    ALLOW_DEFAULT = True


class NodeListQuery(Query):
    page_size: int = Field(default=100, ge=1, le=500)
    page_token: Printable | None = Field(default=None, max_length=1000)
    order_by: Literal["node_id"] = "node_id"


#: The builder's description of a Template's inputs is for people; keep it small.
MAX_TEMPLATE_SOURCE = 8192


class TemplatePutIn(VersionedWrite):
    """Point a Template name at three blobs.  `expected_version` is the Template's
    revision; 0 means "only if no Template has this name yet"."""

    image_digest: Digest
    kernel_digest: Digest
    initramfs_digest: Digest
    source: dict[str, Any] | None = None

    @field_validator("source")
    @classmethod
    def _small(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and len(json.dumps(v)) > MAX_TEMPLATE_SOURCE:
            raise ValueError(f"at most {MAX_TEMPLATE_SOURCE} bytes of JSON")
        return v


# -------------------------------------------------------------------------- results


class Result(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HealthOut(Result):
    status: Literal["ok"]
    version: str


class ExchangeOut(Result):
    identity_id: str
    credential: str
    kind: Literal["node", "operator"]
    node_id: str | None
    #: The cluster CA certificate (PEM) data-plane certificates chain to.
    cluster_ca: str | None = None


class WhoAmIOut(Result):
    identity_id: str
    kind: Literal["node", "operator"]
    node_id: str | None
    name: str | None


class GrantCreateOut(Result):
    grant_id: str
    token: str
    kind: Literal["node", "operator"]
    node_id: str | None
    name: str | None
    expires_at: str | None


class GrantOut(Result):
    grant_id: str
    kind: Literal["node", "operator"]
    node_id: str | None
    name: str | None
    state: Literal["pending", "used", "expired", "revoked"]
    created_at: str
    created_by: str | None
    expires_at: str | None
    used_at: str | None
    identity_id: str | None
    revoked_at: str | None


class IdentityOut(Result):
    identity_id: str
    kind: Literal["node", "operator"]
    node_id: str | None
    name: str | None
    grant_id: str
    state: Literal["active", "revoked"]
    created_at: str
    revoked_at: str | None


class GrantListOut(Result):
    grants: list[GrantOut]
    identities: list[IdentityOut]


class RevokeOut(Result):
    revoked: list[str]


class ClockOut(Result):
    offset_ms: float
    uncertainty_ms: float
    sync_status: str | None
    measured_at: str
    over: bool


class SessionOut(Result):
    incarnation: int
    session_id: str | None
    release_version: str | None
    source_revision: str | None
    alive: bool
    started_at: str | None
    ended_at: str | None
    clock: ClockOut | None


class Amount(Result):
    cpu_millis: int
    memory_bytes: int


class ReportOut(Result):
    at: str
    allocated: Amount
    instance_count: int
    volume_count: int


class RatioOut(Result):
    ratio: str
    source: Literal["default", "override"]


class NodeOvercommitOut(Result):
    cpu: RatioOut
    memory: RatioOut
    confirmed: bool


class PlacementOut(Result):
    eligible: bool
    reason: str | None


class NodeOut(Result):
    node_id: str
    admission: Literal["admitted", "revoked"]
    drain_requested: bool
    isolated: bool
    isolated_incarnation: int | None
    retired: bool
    retired_at: str | None
    status: Literal["RETIRED", "REVOKED", "ISOLATED", "DRAINED", "DRAINING", "READY", "OFFLINE"]
    registration_version: int
    latest_session: SessionOut | None
    latest_report: ReportOut | None
    resources: Amount
    schedulable: Amount
    overcommit: NodeOvercommitOut
    memory_tight: bool
    memory_tight_since: str | None
    dataplane_address: str | None
    placement: PlacementOut
    host_usage: dict[str, Any] | None = None


class NodeListOut(Result):
    nodes: list[NodeOut]
    next_page_token: str | None


class IsolateOut(Result):
    node: NodeOut
    released_volumes: int
    released_retained_layers: int
    failed_workspaces: int


class RatiosOut(Result):
    cpu: str
    memory: str


class OverrideOut(Result):
    node_id: str
    cpu: str | None
    memory: str | None
    registration_version: int


class OvercommitOut(Result):
    default: RatiosOut
    version: int
    overrides: list[OverrideOut]


class ArtifactOut(Result):
    digest: str
    size: int
    created: bool


class TemplateImageOut(Result):
    digest: str
    size: int


class TemplateOut(Result):
    name: str
    image: TemplateImageOut
    kernel_digest: str
    initramfs_digest: str
    source: dict[str, Any] | None
    created_at: str
    updated_at: str
    revision: int


class TemplatePutOut(Result):
    template: TemplateOut
    outcome: Literal["created", "updated", "unchanged"]


class TemplateListOut(Result):
    templates: list[TemplateOut]


class ErrorBody(Result):
    code: str
    message: str
    details: dict[str, Any] | None = None


class ErrorOut(Result):
    error: ErrorBody
