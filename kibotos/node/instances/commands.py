"""The node's session command handlers: each parses its arguments with the command's
type in `kibotos.protocol.commands` (the same type ctrl builds them from) and calls the
Instance manager, the storage or the transfers.

ctrl checks every ID when it makes one; the node checks again (spec: "The node checks
again before use and rejects any command whose ID does not fit the shape, without
writing any file"), because IDs become file names, unit names and paths here.  A bad
argument is `invalid_argument` naming the field; unknown fields are refused so a
contract drift between ctrl and node shows up at the first command.
"""

from __future__ import annotations

from typing import Any, Protocol

from kibotos.node.instances.contract import CommandHandler
from kibotos.protocol import (
    CreateSpec,
    DestroyArgs,
    DrainArgs,
    LayerDeleteArgs,
    NetworkPolicy,
    ObjectCopyArgs,
    ObjectExpandArgs,
    ObjectExportArgs,
    ObjectImportArgs,
    SetNetworkArgs,
    StopArgs,
    VolumeCreateArgs,
    VolumeDeleteArgs,
    parse_args,
)


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

    async def set_network(self, instance_id: str, network: NetworkPolicy, revision: int
                          ) -> dict[str, Any]: ...

    def set_drain_requested(self, requested: bool) -> None: ...


def command_handlers(target: CommandTarget) -> dict[str, CommandHandler]:
    """The session command handlers of docs/architecture.md, by kind; a target with a
    ``storage`` attribute (a `StorageTarget`) also answers the storage commands."""
    storage: StorageTarget | None = getattr(target, "storage", None)

    async def create(args: dict[str, Any]) -> dict[str, Any]:
        return await target.create(parse_args(CreateSpec, args))

    async def stop(args: dict[str, Any]) -> dict[str, Any]:
        parsed = parse_args(StopArgs, args)
        return await target.stop(parsed.instance_id, force=parsed.force,
                                 deadline_s=parsed.deadline_s)

    async def destroy(args: dict[str, Any]) -> dict[str, Any]:
        return await target.destroy(parse_args(DestroyArgs, args).instance_id)

    async def layer_delete(args: dict[str, Any]) -> dict[str, Any]:
        parsed = parse_args(LayerDeleteArgs, args)
        return await target.delete_layer(parsed.pool_id, parsed.ref, parsed.epoch)

    async def set_network(args: dict[str, Any]) -> dict[str, Any]:
        parsed = parse_args(SetNetworkArgs, args)
        return await target.set_network(parsed.instance_id, parsed.network, parsed.revision)

    async def drain(args: dict[str, Any]) -> dict[str, Any]:
        target.set_drain_requested(parse_args(DrainArgs, args).requested)
        return {"drain_requested": target.drain_requested}

    return {CreateSpec.KIND: create, StopArgs.KIND: stop, DestroyArgs.KIND: destroy,
            LayerDeleteArgs.KIND: layer_delete, DrainArgs.KIND: drain,
            SetNetworkArgs.KIND: set_network,
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
        a = parse_args(ObjectExportArgs, args)
        return await transfers.export(a.kind.value, a.pool_id, a.object_id, a.epoch)

    async def import_(args: dict[str, Any]) -> dict[str, Any]:
        a = parse_args(ObjectImportArgs, args)
        return await transfers.import_(a.kind.value, a.pool_id, a.object_id, a.artifact_digest,
                                       a.epoch)

    return {ObjectExportArgs.KIND: export, ObjectImportArgs.KIND: import_}


def storage_handlers(storage: StorageTarget) -> dict[str, CommandHandler]:
    """``volume.create``, ``volume.delete``, ``object.expand``, ``object.copy``."""

    async def volume_create(args: dict[str, Any]) -> dict[str, Any]:
        a = parse_args(VolumeCreateArgs, args)
        return await storage.volume_create(a.volume_id, a.pool_id, a.capacity_bytes, a.epoch)

    async def volume_delete(args: dict[str, Any]) -> dict[str, Any]:
        a = parse_args(VolumeDeleteArgs, args)
        return await storage.volume_delete(a.volume_id, a.pool_id, a.epoch)

    async def object_expand(args: dict[str, Any]) -> dict[str, Any]:
        a = parse_args(ObjectExpandArgs, args)
        return await storage.object_expand(a.kind.value, a.pool_id, a.object_id, a.epoch,
                                           a.capacity_bytes)

    async def object_copy(args: dict[str, Any]) -> dict[str, Any]:
        a = parse_args(ObjectCopyArgs, args)
        return await storage.object_copy(a.kind.value, a.object_id, a.from_pool_id, a.to_pool_id,
                                         a.epoch)

    return {VolumeCreateArgs.KIND: volume_create, VolumeDeleteArgs.KIND: volume_delete,
            ObjectExpandArgs.KIND: object_expand, ObjectCopyArgs.KIND: object_copy}
