"""The pool object commands: writable layers and Volumes made, deleted, grown, copied
between pools, exported to and imported from ctrl's artifact store (docs/architecture.md,
"Session commands for Instances"; docs/storage.md).  Each names the object's epoch: the
node takes the use right at it, and an older one is refused as taken over."""

from __future__ import annotations

from typing import ClassVar

from pydantic import model_validator

from kibotos.protocol.commands.base import Args
from kibotos.protocol.ids import Digest, LayerRefId, ObjectId, PoolId, VolumeId
from kibotos.protocol.states import ObjectKind
from kibotos.protocol.values import Capacity, Epoch, WireEnum


class LayerDeleteArgs(Args):
    KIND: ClassVar[str] = "layer.delete"

    pool_id: PoolId
    ref: LayerRefId
    epoch: Epoch


class VolumeCreateArgs(Args):
    KIND: ClassVar[str] = "volume.create"

    volume_id: VolumeId
    pool_id: PoolId
    capacity_bytes: Capacity
    epoch: Epoch


class VolumeDeleteArgs(Args):
    KIND: ClassVar[str] = "volume.delete"

    volume_id: VolumeId
    pool_id: PoolId
    epoch: Epoch


class ObjectExpandArgs(Args):
    """Grow a block file to `capacity_bytes` (never shrink)."""

    KIND: ClassVar[str] = "object.expand"

    kind: WireEnum[ObjectKind]
    pool_id: PoolId
    object_id: ObjectId
    epoch: Epoch
    capacity_bytes: Capacity


class ObjectCopyArgs(Args):
    """Copy an object into another pool the node reaches; the source stays."""

    KIND: ClassVar[str] = "object.copy"

    kind: WireEnum[ObjectKind]
    object_id: ObjectId
    from_pool_id: PoolId
    to_pool_id: PoolId
    epoch: Epoch

    @model_validator(mode="after")
    def _two_pools(self) -> ObjectCopyArgs:
        if self.from_pool_id == self.to_pool_id:
            raise ValueError(f"from_pool_id and to_pool_id are both {self.from_pool_id}")
        return self


class ObjectExportArgs(Args):
    """Pack the object into a Transfer archive and upload it to ctrl."""

    KIND: ClassVar[str] = "object.export"

    kind: WireEnum[ObjectKind]
    pool_id: PoolId
    object_id: ObjectId
    epoch: Epoch


class ObjectImportArgs(Args):
    """Download a Transfer archive from ctrl and unpack it as a new object."""

    KIND: ClassVar[str] = "object.import"

    kind: WireEnum[ObjectKind]
    pool_id: PoolId
    object_id: ObjectId
    artifact_digest: Digest
    epoch: Epoch
