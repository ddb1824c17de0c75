"""The Instance commands: ``instance.create`` (`CreateSpec`), ``instance.stop``,
``instance.destroy``, and ``node.drain`` (docs/architecture.md, "Session commands for
Instances")."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, Field, StrictBool, StrictFloat, StrictStr, field_validator

from kibotos import volume_mounts
from kibotos.protocol.commands.base import Args, Part
from kibotos.protocol.commands.network import NetworkPolicy
from kibotos.protocol.ids import (
    Digest,
    InstanceId,
    LayerRefId,
    PoolId,
    TemplateName,
    VolumeId,
    WorkspaceId,
    as_validator,
)
from kibotos.protocol.values import Capacity, Epoch, InstanceCpuMillis, InstanceMemory, Revision

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
#: ctrl's ceiling on the Volumes of one Workspace.
MAX_VOLUMES = 16
MAX_ENV = 64
MAX_ENV_VALUE = 4096


class TemplateRef(Part):
    """The Template to boot, by name and its three blobs' digests."""

    name: TemplateName
    image_digest: Digest
    kernel_digest: Digest
    initramfs_digest: Digest


class LayerRef(Part):
    """The writable layer: a block file in `pool_id`, made when `create` is set."""

    pool_id: PoolId
    ref: LayerRefId
    capacity_bytes: Capacity
    epoch: Epoch
    create: StrictBool = False


MountPoint = Annotated[StrictStr, as_validator(volume_mounts.check_mount_point)]


class VolumeRef(Part):
    """A Volume to attach, at its epoch; mounted at `mount_point` in the guest."""

    volume_id: VolumeId
    pool_id: PoolId
    epoch: Epoch
    mount_point: MountPoint | None = None  # default /mnt/<volume_id> (`mount`)

    def mount(self) -> str:
        """Where the guest mounts this Volume."""
        return self.mount_point or volume_mounts.default_mount_point(self.volume_id)


def _env_names(env: dict[str, str]) -> dict[str, str]:
    for name in env:
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"invalid environment variable name {name!r}")
    return env


class LaunchArgs(Part):
    """What the guest is told at boot."""

    hostname: Annotated[StrictStr, Field(max_length=64)] | None = None
    env: Annotated[dict[str, Annotated[StrictStr, Field(max_length=MAX_ENV_VALUE)]],
                   Field(max_length=MAX_ENV), AfterValidator(_env_names)] = \
        Field(default_factory=dict)


#: Optional `CreateSpec` fields left out of the wire when not set (see `to_wire`).
_UNSET_WHEN_NONE = ("network", "network_revision")


class CreateSpec(Args):
    """``instance.create``: answered after the node's own admission, the boot going on
    in the background.  A repeat with the same arguments is a replay (`digest`)."""

    KIND: ClassVar[str] = "instance.create"

    instance_id: InstanceId
    workspace_id: WorkspaceId
    template: TemplateRef
    cpu_millis: InstanceCpuMillis
    memory_bytes: InstanceMemory
    layer: LayerRef
    volumes: Annotated[list[VolumeRef], Field(max_length=MAX_VOLUMES)] = \
        Field(default_factory=list)
    launch: LaunchArgs = Field(default_factory=LaunchArgs)
    #: None: the Instance gets no network interface at all (as before networking).
    network: NetworkPolicy | None = None
    #: The revision of `network` (`instance.set_network` orders switches by it).
    network_revision: Revision | None = None

    @field_validator("volumes")
    @classmethod
    def _distinct(cls, v: list[VolumeRef]) -> list[VolumeRef]:
        seen = set()
        for vol in v:
            key = (vol.pool_id, vol.volume_id)
            if key in seen:
                raise ValueError(f"volume {vol.volume_id} of pool {vol.pool_id} is listed twice")
            seen.add(key)
        mounts = [vol.mount() for vol in v]
        if len(set(mounts)) != len(mounts):
            raise ValueError("two volumes share a mount point")
        return v

    def to_wire(self) -> dict[str, Any]:
        """Every field, except a `network` that is not set: a node of an earlier
        version refuses fields it does not know, and an Instance without a network is
        what it makes anyway."""
        wire = super().to_wire()
        for key in _UNSET_WHEN_NONE:
            if wire.get(key) is None:
                wire.pop(key, None)
        return wire

    def digest(self) -> str:
        """Identity of the arguments: a repeated create with the same digest is a replay
        (the same digest as before `network` existed, for a create without one)."""
        text = json.dumps(self.to_wire(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


class StopArgs(Args):
    """``instance.stop``: returns when the VMM is gone and its objects released."""

    KIND: ClassVar[str] = "instance.stop"

    instance_id: InstanceId
    force: StrictBool = False
    deadline_s: Annotated[StrictFloat, Field(gt=0, le=3600)] = 30.0


class DestroyArgs(Args):
    """``instance.destroy``: returns when everything of the Instance is released."""

    KIND: ClassVar[str] = "instance.destroy"

    instance_id: InstanceId


class DrainArgs(Args):
    """``node.drain``: while requested, the node refuses creates."""

    KIND: ClassVar[str] = "node.drain"

    requested: StrictBool
