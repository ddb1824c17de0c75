"""Request and result shapes of the Workspace API (docs/workspaces.md).

Kept beside `kibotos.ctrl.wire.base` (whose base classes it uses) so the Workspace API can
grow without every resource editing one file.  As there, requests refuse unknown fields
and check every documented shape before the command journal sees them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from kibotos.core.errors import InvalidArgument
from kibotos.ctrl.model import workspace_records as workspaces
from kibotos.ctrl.wire.base import (
    Query,
    Result,
    VersionedWrite,
    WaitQuery,
    WriteRequest,
    _as_value_error,
)
from kibotos.ctrl.wire.network import AppliedNetworkOut, NetworkIn, WorkspaceNetworkOut
from kibotos.ctrl.wire.volumes import VolumeAttachIn, check_attachments, whole_mib
from kibotos.protocol.commands.instances import MAX_VOLUMES
from kibotos.protocol.ids import InstanceId, NodeId, TemplateName
from kibotos.protocol.values import (
    MAX_CAPACITY,
    MAX_INSTANCE_CPU_MILLIS,
    MIN_INSTANCE_MEMORY,
    InstanceCpuMillis,
    InstanceMemory,
    Printable,
)

MIB = 1 << 20
DEFAULT_CPU_MILLIS = 1000
DEFAULT_MEMORY_BYTES = 1 << 30
DEFAULT_LAYER_SIZE_BYTES = 10 << 30
MIN_MEMORY_BYTES = MIN_INSTANCE_MEMORY
MIN_LAYER_SIZE_BYTES = 64 * MIB
MAX_CPU_MILLIS = MAX_INSTANCE_CPU_MILLIS

class WorkspaceCreateIn(WriteRequest):
    template: TemplateName
    labels: dict[str, str] = Field(default_factory=dict,
                                   json_schema_extra=workspaces.LABELS_SCHEMA)
    node_id: NodeId | None = None
    #: The rules of ``instance.create``'s (`kibotos.protocol`): a Workspace that passes
    #: them is one every node boots.
    cpu_millis: InstanceCpuMillis = DEFAULT_CPU_MILLIS
    memory_bytes: InstanceMemory = DEFAULT_MEMORY_BYTES
    layer_size_bytes: int = Field(default=DEFAULT_LAYER_SIZE_BYTES, le=MAX_CAPACITY)
    #: Volumes to attach, each with its guest mount point (docs/storage.md, "Volumes").
    volumes: list[VolumeAttachIn] = Field(default_factory=list, max_length=MAX_VOLUMES)
    #: The network policy (docs/network.md); absent: the deployment default, the
    #: network its node provides (public egress on, no lists, where the node has it).
    network: NetworkIn | None = None

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        checked: dict[str, str] = _as_value_error(workspaces.check_labels, v)
        return checked

    @field_validator("layer_size_bytes")
    @classmethod
    def _layer(cls, v: int) -> int:
        # Its ceiling (`MAX_CAPACITY`, the field's ``le``) is checked before this.
        return whole_mib(v, "layer_size_bytes", MIN_LAYER_SIZE_BYTES, MAX_CAPACITY)

    @field_validator("volumes")
    @classmethod
    def _volumes(cls, v: list[VolumeAttachIn]) -> list[VolumeAttachIn]:
        return check_attachments(v)


class WorkspaceStartIn(VersionedWrite):
    node_id: NodeId | None = None


class WorkspaceStopIn(VersionedWrite):
    force: bool = False


def _split_labels(value: str | None) -> dict[str, str]:
    """``k=v,k2=v2`` (the form of repeated ``--label k=v``) → a checked mapping."""
    if not value:
        return {}
    labels: dict[str, str] = {}
    for item in value.split(","):
        key, sep, val = item.partition("=")
        if not sep:
            raise InvalidArgument(f"invalid label filter {item!r}: expected key=value")
        if key in labels:
            raise InvalidArgument(f"label {key!r} is given twice")
        labels[key] = val
    return workspaces.check_labels(labels)


def _split_states(value: str | None) -> list[str]:
    if not value:
        return []
    states = [s.strip().upper() for s in value.split(",") if s.strip()]
    for state in states:
        if state not in workspaces.STATES:
            raise InvalidArgument(f"unknown state {state!r} (states: "
                                  f"{', '.join(workspaces.STATES)})")
    return states


class WorkspaceListQuery(Query):
    state: str | None = None
    label: str | None = None
    page_size: int = Field(default=100, ge=1, le=500)
    page_token: Printable | None = Field(default=None, max_length=1000)

    @field_validator("state")
    @classmethod
    def _state(cls, v: str | None) -> str | None:
        _as_value_error(_split_states, v)
        return v

    @field_validator("label")
    @classmethod
    def _label(cls, v: str | None) -> str | None:
        _as_value_error(_split_labels, v)
        return v

    def states(self) -> list[str]:
        return _split_states(self.state)

    def labels(self) -> dict[str, str]:
        return _split_labels(self.label)


class LocationQuery(Query):
    node_id: NodeId | None = None
    instance_id: InstanceId | None = None
    page_size: int = Field(default=100, ge=1, le=500)
    page_token: Printable | None = Field(default=None, max_length=1000)

    @model_validator(mode="after")
    def _one(self) -> LocationQuery:
        if (self.node_id is None) == (self.instance_id is None):
            raise ValueError("give exactly one of node_id and instance_id")
        return self


class WorkspaceGetQuery(WaitQuery):
    """``wait_s``: wait up to this long for the Workspace to reach a settled state."""


class MoveCheckQuery(Query):
    node_id: NodeId


# ------------------------------------------------------------------------ results


class TemplateRefOut(Result):
    name: str
    image_digest: str
    kernel_digest: str
    initramfs_digest: str


class ResourcesOut(Result):
    cpu_millis: int
    memory_bytes: int


class LayerOut(Result):
    pool_id: str
    ref: str
    size_bytes: int
    #: How it last changed hands (`kibotos.ctrl.pools.handoffs`); null before any handoff.
    handoff: Literal["CLEAN", "UNKNOWN"] | None = None


class InstanceOut(Result):
    instance_id: str
    node_id: str
    state: str
    reason: str | None
    guest: dict[str, Any] | None
    confirmed_on_disk: bool | None
    #: The policy in force on its node (null: no network) and its revision.
    network: AppliedNetworkOut | None = None
    network_revision: int | None = None
    #: The guest's addresses once its node reports them (null: not reported).
    addresses: list[str] | None = None


WorkspaceState = Literal["CREATING", "STARTING", "AVAILABLE", "STOPPING", "STOPPED",
                         "FAILED", "DELETING", "DELETED"]


class WorkspaceOut(Result):
    workspace_id: str
    template: TemplateRefOut
    labels: dict[str, str]
    state: WorkspaceState
    reason: str | None
    revision: int
    resources: ResourcesOut
    layer: LayerOut
    network: WorkspaceNetworkOut
    node_id: str | None
    instance_id: str | None
    last_node_id: str | None
    last_instance_id: str | None
    created_at: str
    updated_at: str
    deleted_at: str | None
    instance: InstanceOut | None


class WorkspaceListOut(Result):
    workspaces: list[WorkspaceOut]
    next_page_token: str | None


class LocationOut(Result):
    workspace_id: str
    node_id: str | None
    instance_id: str | None


class LocationListOut(Result):
    locations: list[LocationOut]
    next_page_token: str | None


class ObjectOut(Result):
    kind: Literal["retained_layer", "volume"]
    object_id: str
    pool_id: str
    holder_node_id: str | None
    epoch: int


class MoveCheckOut(Result):
    workspace: WorkspaceOut
    node_id: str
    already_there: bool
    objects: list[ObjectOut]
    node_pools: list[str]


class CleanupItemOut(Result):
    item: Literal["RUNTIME", "VOLUME_ATTACHMENT", "RESIDUAL"]
    status: Literal["IN_USE", "PENDING", "RELEASED", "UNKNOWN"]
    source: Literal["node", "control_plane"]
    observed_at: str | None


class CleanupHeldOut(Result):
    item: Literal["RUNTIME", "VOLUME_ATTACHMENT", "RESIDUAL"]
    part: str


class CleanupStatusOut(Result):
    workspace_id: str
    instance_id: str | None
    node_id: str | None
    items: list[CleanupItemOut]
    #: A release stuck on the node (processes left after the VMM unit's stop): since
    #: when, and what it still holds; null and empty otherwise.
    pending_since: str | None = None
    held: list[CleanupHeldOut] = Field(default_factory=list)
