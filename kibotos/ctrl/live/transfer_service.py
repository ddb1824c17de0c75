"""The Transfer service: Volumes through ctrl's artifact store (docs/storage.md,
"Transfer"), behind ``POST /v1/transfers/export`` and ``POST /v1/transfers/import``.

Export ``{volume_id}``: the Volume must be AVAILABLE, attached to no Workspace that
runs, and not being expanded or moved.  ctrl grants its use right to its holder (a
private pool's node keeps it), or to a live node attached to its pool, and sends that
node ``object.export``; the node packs the block file and metadata into a Transfer
archive and uploads it, and ctrl answers ``{volume_id, pool_id, node_id, epoch,
artifact_digest, size, capacity_bytes}`` once the archive is in the store.  The Volume
stays as it was: an export copies.

Import ``{artifact_digest, pool_id?, labels?}``: the archive must be in the store and
hold a Volume (its manifest is read here: kind and capacity); ctrl checks the pool's
room, picks a live node attached to the pool (not drained) and sends ``object.import``
for a new Volume ID at epoch 1, then records the Volume AVAILABLE with its use right at
that epoch, in the same transaction as the command journal.  The node does the work
before ctrl records anything, so the Volume ID comes from the command ID when there is
one: a retry after a lost answer (or a ctrl restart) imports into the same ID, which
the node answers from its metadata, instead of leaving a second copy behind.

Both talk to a node inside the request (an archive of a large Volume takes minutes):
clients must allow for that (`kibo transfer` waits up to ``--timeout``).  A node that
cannot be reached is ``unavailable`` (retry); the node's refusals are passed on.  The
nodes are chosen and called through `VolumeService` (``usable_nodes``, ``call``), the
store rules are in `kibotos.ctrl.pools.transfer_txns`.
"""

from __future__ import annotations

import base64
import hashlib
from functools import partial
from typing import Any

import trio

from kibotos import transfer_archive
from kibotos.core import ids
from kibotos.core.errors import FailedPrecondition, Unavailable
from kibotos.ctrl.live.runtime import Runtime
from kibotos.ctrl.live.volume_service import VolumeService
from kibotos.ctrl.pools import capacity as pool_capacity
from kibotos.ctrl.pools import transfer_txns as tt
from kibotos.ctrl.pools import use_rights
from kibotos.ctrl.store.artifacts import ArtifactStore
from kibotos.ctrl.wire.transfers import TransferExportIn, TransferImportIn
from kibotos.ctrl.wire.volumes import MIN_VOLUME_BYTES
from kibotos.protocol import ObjectExportArgs, ObjectImportArgs, ObjectKind

#: Packing or unpacking streams the whole (sparse) block file through zstd and HTTP.
TRANSFER_TIMEOUT = 6 * 3600.0
#: A new object's first grant (`use_rights.new_right` then `grant`).
FIRST_EPOCH = 1


def import_volume_id(identity_id: str | None, command_id: str | None) -> str:
    """A new Volume ID; derived from the command ID when there is one, so a retry of
    the same import lands on the same object."""
    if command_id is None:
        return ids.new_id("vol")
    digest = hashlib.sha256(f"transfer.import\0{identity_id}\0{command_id}".encode())
    text = base64.b32encode(digest.digest()).decode().lower().rstrip("=")
    return f"vol-{text[:26]}"


class TransferService:
    """Export and import (the module docstring) on the shared `Runtime`."""

    def __init__(self, runtime: Runtime, volumes: VolumeService,
                 artifacts: ArtifactStore) -> None:
        self.runtime = runtime
        self.volumes = volumes
        self.artifacts = artifacts

    async def export_volume(self, body: TransferExportIn,
                            identity: str | None) -> dict[str, Any]:
        rt, volumes = self.runtime, self.volumes
        ctx, journal, store = rt.ctx, rt.journal, rt.store
        rt.require_running()
        replay = await journal.lookup(operation="transfer.export", params={}, body=body)
        if replay is not None:
            return replay.result
        volume_id = body.volume_id
        async with journal.refusals(operation="transfer.export", params={}, body=body,
                                    identity_id=identity):
            pool_id, holder, last = await store.run(partial(tt.export_plan,
                                                            volume_id=volume_id))
        rt.watch.drain()  # the index's node facts up to date
        nodes = volumes.usable_nodes([pool_id], prefer=[holder or last or ""])
        if holder is not None:
            nodes = [n for n in nodes if n == holder]
        if not nodes:
            raise Unavailable(
                f"no live node attached to pool {pool_id} can export volume {volume_id}"
                + (f" (its holder {holder} is not connected)" if holder else "")
                + "; retry later", details={"pool_id": pool_id, "volume_id": volume_id})
        node_id = nodes[0]
        epoch, capacity = await store.write(partial(
            tt.grant_for_export, volume_id=volume_id, node_id=node_id, now=ctx.now()))
        try:
            answer = await volumes.call(node_id, ObjectExportArgs(
                kind=ObjectKind.VOLUME, pool_id=pool_id, object_id=volume_id, epoch=epoch),
                TRANSFER_TIMEOUT)
        except BaseException:
            with trio.CancelScope(shield=True):
                await store.write(partial(tt.release_export, volume_id=volume_id,
                                          node_id=node_id, epoch=epoch, now=ctx.now()))
            raise
        if answer is None:
            await store.write(partial(tt.release_export, volume_id=volume_id,
                                      node_id=node_id, epoch=epoch, now=ctx.now()))
            raise Unavailable(f"node {node_id} did not finish the export of volume "
                              f"{volume_id}; retry", details={"node_id": node_id})
        digest = ids.check_digest(answer.get("artifact_digest"))
        size = await trio.to_thread.run_sync(self.artifacts.size, digest)
        if size is None:
            raise Unavailable(f"node {node_id} exported volume {volume_id} but the archive "
                              f"{digest} is not in the artifact store; retry")
        result = {"volume_id": volume_id, "pool_id": pool_id, "node_id": node_id,
                  "epoch": epoch, "artifact_digest": digest, "size": size,
                  "capacity_bytes": capacity}
        outcome = await journal.execute(
            operation="transfer.export", params={}, body=body, identity_id=identity,
            fn=partial(tt.export_done, result=result, now=ctx.now()))
        return outcome.result

    def _manifest_of(self, digest: str) -> transfer_archive.Manifest:
        path = self.artifacts.path(digest)
        try:
            with open(path, "rb") as f:
                return transfer_archive.read_manifest(f)
        except FileNotFoundError:
            raise FailedPrecondition(
                f"artifact {digest} is not in ctrl's artifact store (export a Volume with "
                "`kibo transfer export`, or upload the archive first)",
                details={"digest": digest}) from None

    async def import_volume(self, body: TransferImportIn,
                            identity: str | None) -> dict[str, Any]:
        rt, volumes = self.runtime, self.volumes
        ctx, journal, store = rt.ctx, rt.journal, rt.store
        rt.require_running()
        replay = await journal.lookup(operation="transfer.import", params={}, body=body)
        if replay is not None:
            return replay.result
        digest = body.artifact_digest
        async with journal.refusals(operation="transfer.import", params={}, body=body,
                                    identity_id=identity):
            manifest = await trio.to_thread.run_sync(self._manifest_of, digest)
            if manifest.kind != use_rights.VOLUME:
                raise FailedPrecondition(
                    f"artifact {digest} holds a {manifest.kind} ({manifest.object_id}), "
                    "not a Volume", details={"digest": digest, "kind": manifest.kind})
            capacity = manifest.capacity_bytes
            if capacity < MIN_VOLUME_BYTES or capacity % (1 << 20):
                raise FailedPrecondition(f"artifact {digest} holds a block file of "
                                         f"{capacity} bytes: not a Volume's capacity")
            pool_id, nodes = volumes.placing_nodes(body.pool_id, "import")
            await store.run(partial(pool_capacity.check_room, pool_id=pool_id,
                                    add_bytes=capacity, what="Volume", now=ctx.now(),
                                    default_capacity=rt.default_capacity))
        node_id = nodes[0]
        volume_id = import_volume_id(identity, body.command_id)
        exists = await store.run(partial(tt.volume_exists, volume_id=volume_id))
        if exists:
            raise FailedPrecondition(f"volume {volume_id} exists already; use another "
                                     "command ID", details={"volume_id": volume_id})
        answer = await volumes.call(node_id, ObjectImportArgs(
            kind=ObjectKind.VOLUME, pool_id=pool_id, object_id=volume_id,
            artifact_digest=digest, epoch=FIRST_EPOCH), TRANSFER_TIMEOUT)
        if answer is None:
            raise Unavailable(f"node {node_id} did not finish the import of {digest}; "
                              "retry with the same command ID",
                              details={"node_id": node_id})
        outcome = await journal.execute(
            operation="transfer.import", params={}, body=body, identity_id=identity,
            fn=partial(tt.record_import, volume_id=volume_id, pool_id=pool_id,
                       shared=volumes.pool_shared(node_id, pool_id),
                       capacity_bytes=capacity, labels=body.labels, node_id=node_id,
                       digest=digest, source=manifest.object_id, now=ctx.now(),
                       default_capacity=rt.default_capacity))
        volumes.changed()
        return outcome.result
