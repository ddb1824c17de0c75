"""The Instance commands' arguments, checked before the node writes anything, and the
handlers that parse them and call the Instance manager.

ctrl checks every ID when it makes one; the node checks again (spec: "The node checks
again before use and rejects any command whose ID does not fit the shape, without
writing any file"), because IDs become file names, unit names and paths here.  A bad
argument is `invalid_argument` naming the field; unknown fields are refused so a
contract drift between ctrl and node shows up at the first command.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal, Protocol, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from kibotos import ids, volume_mounts
from kibotos.errors import InvalidArgument
from kibotos.node.instances.contract import CommandHandler

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def _object_id(kind: str) -> AfterValidator:
    """A validator checking an object ID with `kibotos.ids` (as ctrl does)."""
    def validate(v: str) -> str:
        try:
            return ids.check_object_id(v, kind)
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None
    return AfterValidator(validate)


def _pool_id(v: str) -> str:
    try:
        return ids.check_pool_id(v)
    except InvalidArgument as exc:
        raise ValueError(exc.message) from None


InstanceId = Annotated[str, _object_id("instance ID")]
WorkspaceId = Annotated[str, _object_id("workspace ID")]
LayerRefId = Annotated[str, _object_id("retained layer ref")]
VolumeId = Annotated[str, _object_id("volume ID")]
PoolId = Annotated[str, AfterValidator(_pool_id)]


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TemplateRef(_Args):
    name: str
    image_digest: str
    kernel_digest: str
    initramfs_digest: str

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        try:
            return ids.check_template_name(v)
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None

    @field_validator("image_digest", "kernel_digest", "initramfs_digest")
    @classmethod
    def _digest(cls, v: str) -> str:
        try:
            return ids.check_digest(v)  # canonical sha256:<hex>; bare hex accepted
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None


class LayerRef(_Args):
    pool_id: PoolId
    ref: LayerRefId
    capacity_bytes: int = Field(gt=0)
    epoch: int = Field(ge=0)
    create: bool = False

    @field_validator("capacity_bytes")
    @classmethod
    def _whole_mib(cls, v: int) -> int:
        if v % (1 << 20):
            raise ValueError("must be a whole number of MiB")
        return v


class VolumeRef(_Args):
    volume_id: VolumeId
    pool_id: PoolId
    epoch: int = Field(ge=0)
    mount_point: str | None = None  # default /mnt/<volume_id> (`mount`)

    @field_validator("mount_point")
    @classmethod
    def _mount(cls, v: str | None) -> str | None:
        try:
            return None if v is None else volume_mounts.check_mount_point(v)
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None

    def mount(self) -> str:
        """Where the guest mounts this Volume."""
        return self.mount_point or volume_mounts.default_mount_point(self.volume_id)


class LaunchArgs(_Args):
    hostname: str | None = Field(default=None, max_length=64)
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"invalid environment variable name {name!r}")
        return v


class CreateSpec(_Args):
    """``instance.create`` arguments (docs/architecture.md, "Session commands")."""

    instance_id: InstanceId
    workspace_id: WorkspaceId
    template: TemplateRef
    cpu_millis: int = Field(gt=0, le=1_000_000)
    memory_bytes: int = Field(gt=0)
    layer: LayerRef
    volumes: list[VolumeRef] = Field(default_factory=list)
    launch: LaunchArgs = Field(default_factory=LaunchArgs)

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

    def digest(self) -> str:
        """Identity of the arguments: a repeated create with the same digest is a replay."""
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


class StopArgs(_Args):
    instance_id: InstanceId
    force: bool = False
    deadline_s: float = Field(default=30.0, gt=0, le=3600)



class DestroyArgs(_Args):
    instance_id: InstanceId



class LayerDeleteArgs(_Args):
    pool_id: PoolId
    ref: LayerRefId
    epoch: int = Field(ge=0)




class DrainArgs(_Args):
    requested: bool


def _whole_mib(v: int) -> int:
    if v % (1 << 20):
        raise ValueError("must be a whole number of MiB")
    return v


Capacity = Annotated[int, Field(gt=0), AfterValidator(_whole_mib)]
ObjectId = Annotated[str, _object_id("object ID")]
ObjectKind = Literal["volume", "retained_layer"]


class VolumeCreateArgs(_Args):
    volume_id: VolumeId
    pool_id: PoolId
    capacity_bytes: Capacity
    epoch: int = Field(ge=0)


class VolumeDeleteArgs(_Args):
    volume_id: VolumeId
    pool_id: PoolId
    epoch: int = Field(ge=0)


class ObjectExpandArgs(_Args):
    kind: ObjectKind
    pool_id: PoolId
    object_id: ObjectId
    epoch: int = Field(ge=0)
    capacity_bytes: Capacity


class ObjectCopyArgs(_Args):
    kind: ObjectKind
    object_id: ObjectId
    from_pool_id: PoolId
    to_pool_id: PoolId
    epoch: int = Field(ge=0)


class ObjectExportArgs(_Args):
    kind: ObjectKind
    pool_id: PoolId
    object_id: ObjectId
    epoch: int = Field(ge=0)


class ObjectImportArgs(_Args):
    kind: ObjectKind
    pool_id: PoolId
    object_id: ObjectId
    artifact_digest: str
    epoch: int = Field(ge=0)

    @field_validator("artifact_digest")
    @classmethod
    def _digest(cls, v: str) -> str:
        try:
            return ids.check_digest(v)
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None


M = TypeVar("M", bound=_Args)


def parse_args(model: type[M], kind: str, args: Any) -> M:
    """Validate `args` of command `kind`; `invalid_argument` names every bad field."""
    if not isinstance(args, dict):
        raise InvalidArgument(f"{kind}: args must be an object")
    try:
        return model.model_validate(args)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "args"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown field"
            parts.append(f"{loc}: {msg}")
        raise InvalidArgument(f"{kind}: {'; '.join(parts)}") from None


class StorageTarget(Protocol):
    """What the storage handlers call (`kibotos.node.storage.volume_ops.NodeStorage`)."""

    async def volume_create(self, volume_id: str, pool_id: str, capacity: int, epoch: int
                            ) -> dict[str, Any]: ...

    async def volume_delete(self, volume_id: str, pool_id: str, epoch: int
                            ) -> dict[str, Any]: ...

    async def object_expand(self, kind: str, pool_id: str, object_id: str, epoch: int,
                            capacity: int) -> dict[str, Any]: ...

    async def object_copy(self, kind: str, object_id: str, from_pool_id: str,
                          to_pool_id: str, epoch: int) -> dict[str, Any]: ...


class CommandTarget(Protocol):
    """What the handlers call (`kibotos.node.instances.manager.VmInstanceManager`)."""

    drain_requested: bool

    async def create(self, spec: CreateSpec) -> dict[str, Any]: ...

    async def stop(self, instance_id: str, *, force: bool, deadline_s: float
                   ) -> dict[str, Any]: ...

    async def destroy(self, instance_id: str) -> dict[str, Any]: ...

    async def delete_layer(self, pool_id: str, ref: str, epoch: int) -> dict[str, Any]: ...

    def set_drain_requested(self, requested: bool) -> None: ...


def command_handlers(target: CommandTarget) -> dict[str, CommandHandler]:
    """The session command handlers of docs/architecture.md, by kind; a target with a
    ``storage`` attribute (a `StorageTarget`) also answers the storage commands."""
    storage: StorageTarget | None = getattr(target, "storage", None)

    async def create(args: dict[str, Any]) -> dict[str, Any]:
        return await target.create(parse_args(CreateSpec, "instance.create", args))

    async def stop(args: dict[str, Any]) -> dict[str, Any]:
        parsed = parse_args(StopArgs, "instance.stop", args)
        return await target.stop(parsed.instance_id, force=parsed.force,
                                 deadline_s=parsed.deadline_s)

    async def destroy(args: dict[str, Any]) -> dict[str, Any]:
        return await target.destroy(parse_args(DestroyArgs, "instance.destroy",
                                               args).instance_id)

    async def layer_delete(args: dict[str, Any]) -> dict[str, Any]:
        parsed = parse_args(LayerDeleteArgs, "layer.delete", args)
        return await target.delete_layer(parsed.pool_id, parsed.ref, parsed.epoch)

    async def drain(args: dict[str, Any]) -> dict[str, Any]:
        target.set_drain_requested(parse_args(DrainArgs, "node.drain", args).requested)
        return {"drain_requested": target.drain_requested}

    return {"instance.create": create, "instance.stop": stop, "instance.destroy": destroy,
            "layer.delete": layer_delete, "node.drain": drain,
            **(storage_handlers(storage) if storage is not None else {})}


class TransferTarget(Protocol):
    """What the transfer handlers call (`kibotos.node.storage.transfer.NodeTransfers`)."""

    async def export(self, kind: str, pool_id: str, object_id: str, epoch: int
                     ) -> dict[str, Any]: ...

    async def import_(self, kind: str, pool_id: str, object_id: str, artifact_digest: str,
                      epoch: int) -> dict[str, Any]: ...


def transfer_handlers(transfers: TransferTarget) -> dict[str, CommandHandler]:
    """``object.export`` and ``object.import`` (a Transfer archive in ctrl's artifact
    store; docs/storage.md)."""

    async def export(args: dict[str, Any]) -> dict[str, Any]:
        a = parse_args(ObjectExportArgs, "object.export", args)
        return await transfers.export(a.kind, a.pool_id, a.object_id, a.epoch)

    async def import_(args: dict[str, Any]) -> dict[str, Any]:
        a = parse_args(ObjectImportArgs, "object.import", args)
        return await transfers.import_(a.kind, a.pool_id, a.object_id, a.artifact_digest,
                                       a.epoch)

    return {"object.export": export, "object.import": import_}


def storage_handlers(storage: StorageTarget) -> dict[str, CommandHandler]:
    """``volume.create``, ``volume.delete``, ``object.expand``, ``object.copy``."""

    async def volume_create(args: dict[str, Any]) -> dict[str, Any]:
        a = parse_args(VolumeCreateArgs, "volume.create", args)
        return await storage.volume_create(a.volume_id, a.pool_id, a.capacity_bytes, a.epoch)

    async def volume_delete(args: dict[str, Any]) -> dict[str, Any]:
        a = parse_args(VolumeDeleteArgs, "volume.delete", args)
        return await storage.volume_delete(a.volume_id, a.pool_id, a.epoch)

    async def object_expand(args: dict[str, Any]) -> dict[str, Any]:
        a = parse_args(ObjectExpandArgs, "object.expand", args)
        return await storage.object_expand(a.kind, a.pool_id, a.object_id, a.epoch,
                                           a.capacity_bytes)

    async def object_copy(args: dict[str, Any]) -> dict[str, Any]:
        a = parse_args(ObjectCopyArgs, "object.copy", args)
        return await storage.object_copy(a.kind, a.object_id, a.from_pool_id, a.to_pool_id,
                                         a.epoch)

    return {"volume.create": volume_create, "volume.delete": volume_delete,
            "object.expand": object_expand, "object.copy": object_copy}
