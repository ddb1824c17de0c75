"""Request and result shapes of the Volume API and of the object operations (expand,
move) of Volumes and writable layers (docs/storage.md, "Volumes").

As everywhere in the API, requests refuse unknown fields and check every documented
shape (IDs, sizes, mount points) before the command journal sees them, so bad input
writes nothing.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic.config import JsonDict

from kibotos import volume_mounts
from kibotos.ctrl.model import workspace_records as workspaces
from kibotos.ctrl.wire.base import (
    Query,
    Request,
    Result,
    VersionedWrite,
    WaitQuery,
    WriteRequest,
    _as_value_error,
)
from kibotos.protocol.ids import PoolId, VolumeId, WorkspaceId
from kibotos.protocol.values import Printable

MIB = 1 << 20
MIN_VOLUME_BYTES = 64 * MIB
#: 64 TiB: far above any pool here, low enough that a typo (a missing unit) is caught.
MAX_OBJECT_BYTES = 64 << 40


def whole_mib(value: int, what: str, minimum: int, maximum: int = MAX_OBJECT_BYTES) -> int:
    """A size of a block file (a Volume, a writable layer) `what` names: from `minimum`
    to `maximum` and a whole number of MiB, said in MiB and TiB."""
    if value < minimum:
        raise ValueError(f"{what} must be at least {minimum // MIB} MiB")
    if value > maximum:
        raise ValueError(f"{what} must be at most {maximum >> 40} TiB")
    if value % MIB:
        raise ValueError(f"{what} must be a whole number of MiB")
    return value


#: `whole_mib`'s rule as the field's JSON schema (ctrl's OpenAPI document).
_CAPACITY_SCHEMA: JsonDict = {"minimum": MIN_VOLUME_BYTES, "maximum": MAX_OBJECT_BYTES,
                              "multipleOf": MIB}


class VolumeAttachIn(Request):
    """One Volume of a Workspace create: the Volume and where the guest mounts it."""

    volume_id: VolumeId
    mount_point: str | None = None

    @field_validator("mount_point")
    @classmethod
    def _mount(cls, v: str | None) -> str | None:
        return None if v is None else _as_value_error(volume_mounts.check_mount_point, v)

    def mount(self) -> str:
        return self.mount_point or volume_mounts.default_mount_point(self.volume_id)


def check_attachments(items: list[VolumeAttachIn]) -> list[VolumeAttachIn]:
    """No Volume and no mount point twice."""
    seen_ids: set[str] = set()
    seen_mounts: set[str] = set()
    for item in items:
        if item.volume_id in seen_ids:
            raise ValueError(f"volume {item.volume_id} is given twice")
        if item.mount() in seen_mounts:
            raise ValueError(f"mount point {item.mount()} is given twice")
        seen_ids.add(item.volume_id)
        seen_mounts.add(item.mount())
    return items


class VolumeCreateIn(WriteRequest):
    #: None: the one default pool of the nodes that can create it.
    pool_id: PoolId | None = None
    capacity_bytes: int = Field(json_schema_extra=_CAPACITY_SCHEMA)
    labels: dict[str, str] = Field(default_factory=dict,
                                   json_schema_extra=workspaces.LABELS_SCHEMA)

    @field_validator("capacity_bytes")
    @classmethod
    def _capacity(cls, v: int) -> int:
        return whole_mib(v, "capacity_bytes", MIN_VOLUME_BYTES)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        checked: dict[str, str] = _as_value_error(workspaces.check_labels, v)
        return checked


class ExpandIn(VersionedWrite):
    """Expand a Volume or a writable layer to `capacity_bytes` (never shrink)."""

    capacity_bytes: int = Field(json_schema_extra=_CAPACITY_SCHEMA)

    @field_validator("capacity_bytes")
    @classmethod
    def _capacity(cls, v: int) -> int:
        return whole_mib(v, "capacity_bytes", MIN_VOLUME_BYTES)


class MoveIn(VersionedWrite):
    """Move a Volume or a writable layer into another pool."""

    pool_id: PoolId


class VolumeListQuery(Query):
    pool_id: PoolId | None = None
    workspace_id: WorkspaceId | None = None
    #: Also DELETED Volumes.
    deleted: bool = False
    page_size: int = Field(default=100, ge=1, le=500)
    page_token: Printable | None = Field(default=None, max_length=1000)


class VolumeGetQuery(WaitQuery):
    """``wait_s``: wait up to this long for a settled state (no operation running)."""


# ------------------------------------------------------------------------ results


class OperationOut(Result):
    op: Literal["expand", "move"]
    status: Literal["running", "cleanup", "failed"]
    pool_id: str
    target_pool_id: str | None
    target_capacity_bytes: int | None
    node_id: str | None
    error: str | None
    started_at: str
    updated_at: str


VolumeState = Literal["CREATING", "AVAILABLE", "FAILED", "DELETING", "DELETED"]


class VolumeOut(Result):
    volume_id: str
    pool_id: str
    capacity_bytes: int
    state: VolumeState
    reason: str | None
    labels: dict[str, str]
    workspace_id: str | None
    mount_point: str | None
    holder_node_id: str | None
    epoch: int | None
    #: How it last changed hands (`kibotos.ctrl.pools.handoffs`); null before any handoff.
    handoff: Literal["CLEAN", "UNKNOWN"] | None = None
    operation: OperationOut | None
    revision: int
    created_at: str
    updated_at: str
    deleted_at: str | None


class VolumeListOut(Result):
    volumes: list[VolumeOut]
    next_page_token: str | None


class LayerStatusOut(Result):
    workspace_id: str
    state: str
    revision: int
    pool_id: str
    ref: str
    size_bytes: int
    operation: OperationOut | None
