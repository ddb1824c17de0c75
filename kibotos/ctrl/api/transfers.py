"""Transfer of Volumes through ctrl's artifact store (docs/storage.md, "Transfer"):
``POST /v1/transfers/export`` and ``POST /v1/transfers/import``.

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
cannot be reached is ``unavailable`` (retry); the node's refusals are passed on.
"""

from __future__ import annotations

import base64
import hashlib
from datetime import datetime
from functools import partial
from typing import Any

import trio
from pydantic import Field, field_validator
from sqlalchemy.orm import Session
from starlette.requests import Request

from kibotos import ids, transfer_archive
from kibotos.ctrl.api.auth import Caller
from kibotos.ctrl.api.routing import Api, Route, read_body
from kibotos.ctrl.live.journal import STORED_ERRORS
from kibotos.ctrl.live.workspace_service import WorkspaceService
from kibotos.ctrl.model.nodes import record_event
from kibotos.ctrl.model.workspace_records import check_labels
from kibotos.ctrl.pools import capacity as pool_capacity
from kibotos.ctrl.pools import use_rights
from kibotos.ctrl.pools import volume_txns as vt
from kibotos.ctrl.store.artifacts import ArtifactStore
from kibotos.ctrl.store.models import UseRight, Volume
from kibotos.ctrl.wire.base import Result, WriteRequest, _as_value_error
from kibotos.ctrl.wire.volumes import MIN_VOLUME_BYTES, VolumeOut
from kibotos.errors import FailedPrecondition, Unavailable
from kibotos.protocol import ObjectExportArgs, ObjectImportArgs, ObjectKind
from kibotos.protocol.ids import Digest, PoolId, VolumeId

#: Packing or unpacking streams the whole (sparse) block file through zstd and HTTP.
TRANSFER_TIMEOUT = 6 * 3600.0
#: A new object's first grant (`use_rights.new_right` then `grant`).
FIRST_EPOCH = 1


class TransferExportIn(WriteRequest):
    volume_id: VolumeId


class TransferImportIn(WriteRequest):
    artifact_digest: Digest
    #: None: the one default pool of the nodes that can take it.
    pool_id: PoolId | None = None
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        checked: dict[str, str] = _as_value_error(check_labels, v)
        return checked


class TransferExportOut(Result):
    volume_id: str
    pool_id: str
    node_id: str
    epoch: int
    artifact_digest: str
    size: int
    capacity_bytes: int


class TransferImportOut(Result):
    volume: VolumeOut
    artifact_digest: str
    node_id: str
    source_volume_id: str


# ------------------------------------------------------------------------ transactions


def _exportable(session: Session, volume_id: str) -> tuple[UseRight, int]:
    """The Volume's use right, after checking it may be exported now; and capacity."""
    vol = vt.get_volume(session, volume_id)
    if vol.state != vt.AVAILABLE:
        raise FailedPrecondition(f"volume {volume_id} is {vol.state}, not AVAILABLE",
                                 details={"volume_id": volume_id, "state": vol.state})
    ws = vt.attached_workspace(session, vol)
    if ws is not None:
        vt.workspace_stopped(session, ws)
    op = vt.busy_operation(session, use_rights.VOLUME, volume_id)
    if op is not None:
        raise FailedPrecondition(
            f"volume {volume_id} is being {'expanded' if op.op == 'expand' else 'moved'}: "
            "export it once that is done",
            details={"volume_id": volume_id, "operation": op.op})
    right = session.get(UseRight, (use_rights.VOLUME, volume_id))
    if right is None:
        raise FailedPrecondition(f"volume {volume_id} has no use right record",
                                 details={"volume_id": volume_id})
    return right, vol.capacity_bytes


def export_plan(session: Session, volume_id: str) -> tuple[str, str | None, str | None]:
    """(pool, holder, last holder) of an exportable Volume."""
    right, _ = _exportable(session, volume_id)
    return right.pool_id, right.holder_node_id, right.last_holder_node_id


def grant_for_export(session: Session, volume_id: str, node_id: str, now: datetime
                     ) -> tuple[int, int]:
    """Check again and grant the use right to the exporting node: (epoch, capacity)."""
    right, capacity = _exportable(session, volume_id)
    right = session.get(UseRight, (use_rights.VOLUME, volume_id), with_for_update=True) \
        or right
    return use_rights.grant(right, node_id, now), capacity


def release_export(session: Session, *, volume_id: str, node_id: str, epoch: int,
                   now: datetime) -> None:
    """The export is over (done or not): as after a stop, a shared pool's object is held
    by nobody again; a private pool's node keeps it."""
    right = session.get(UseRight, (use_rights.VOLUME, volume_id), with_for_update=True)
    if right is not None and right.holder_node_id == node_id and right.epoch == epoch:
        use_rights.release_after_stop(right, now)


def export_done(session: Session, *, result: dict[str, Any], now: datetime
                ) -> dict[str, Any]:
    release_export(session, volume_id=result["volume_id"], node_id=result["node_id"],
                   epoch=result["epoch"], now=now)
    record_event(session, now, result["volume_id"], "transfer.exported",
                 {"artifact_digest": result["artifact_digest"], "size": result["size"],
                  "node_id": result["node_id"], "epoch": result["epoch"]})
    return result


def record_import(session: Session, *, volume_id: str, pool_id: str, shared: bool,
                  capacity_bytes: int, labels: dict[str, str], node_id: str,
                  digest: str, source: str, now: datetime, default_capacity: int | None
                  ) -> dict[str, Any]:
    """The imported Volume, AVAILABLE, its use right at the epoch the node wrote."""
    vt.begin_create(session, volume_id=volume_id, pool_id=pool_id, shared=shared,
                    capacity_bytes=capacity_bytes, labels=labels, node_id=node_id, now=now,
                    default_capacity=default_capacity)
    vt.create_done(session, volume_id=volume_id, node_id=node_id, now=now)
    record_event(session, now, volume_id, "transfer.imported",
                 {"artifact_digest": digest, "node_id": node_id, "source": source})
    volume = vt.get_json(session, volume_id)
    return {"volume": volume, "artifact_digest": digest, "node_id": node_id,
            "source_volume_id": source}


def import_volume_id(identity_id: str | None, command_id: str | None) -> str:
    """A new Volume ID; derived from the command ID when there is one, so a retry of
    the same import lands on the same object."""
    if command_id is None:
        return ids.new_id("vol")
    digest = hashlib.sha256(f"transfer.import\0{identity_id}\0{command_id}".encode())
    text = base64.b32encode(digest.digest()).decode().lower().rstrip("=")
    return f"vol-{text[:26]}"


# ------------------------------------------------------------------------ routes


def routes(api: Api, artifacts: ArtifactStore) -> list[Route]:
    ctx = api.ctx
    if ctx.workspaces is None:
        ctx.workspaces = WorkspaceService(ctx)
    service: WorkspaceService = ctx.workspaces
    volumes, journal, store = service.volumes, api.journal, ctx.store

    async def export(request: Request, caller: Caller | None) -> dict[str, Any]:
        body = await read_body(request, TransferExportIn)
        identity = caller.identity_id if caller is not None else None
        service.require_running()
        replay = await journal.lookup(operation="transfer.export", params={}, body=body)
        if replay is not None:
            return replay.result
        volume_id = body.volume_id
        try:
            pool_id, holder, last = await store.run(partial(export_plan,
                                                            volume_id=volume_id))
        except STORED_ERRORS as exc:
            await journal.refuse(operation="transfer.export", params={}, body=body,
                                 identity_id=identity, exc=exc)
            raise  # pragma: no cover - refuse always raises
        service.watch.drain()  # the index's node facts up to date
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
            grant_for_export, volume_id=volume_id, node_id=node_id, now=ctx.now()))
        try:
            answer = await volumes.call(node_id, ObjectExportArgs(
                kind=ObjectKind.VOLUME, pool_id=pool_id, object_id=volume_id, epoch=epoch),
                TRANSFER_TIMEOUT)
        except BaseException:
            with trio.CancelScope(shield=True):
                await store.write(partial(release_export, volume_id=volume_id,
                                          node_id=node_id, epoch=epoch, now=ctx.now()))
            raise
        if answer is None:
            await store.write(partial(release_export, volume_id=volume_id, node_id=node_id,
                                      epoch=epoch, now=ctx.now()))
            raise Unavailable(f"node {node_id} did not finish the export of volume "
                              f"{volume_id}; retry", details={"node_id": node_id})
        digest = ids.check_digest(answer.get("artifact_digest"))
        size = await trio.to_thread.run_sync(artifacts.size, digest)
        if size is None:
            raise Unavailable(f"node {node_id} exported volume {volume_id} but the archive "
                              f"{digest} is not in the artifact store; retry")
        result = {"volume_id": volume_id, "pool_id": pool_id, "node_id": node_id,
                  "epoch": epoch, "artifact_digest": digest, "size": size,
                  "capacity_bytes": capacity}
        outcome = await journal.execute(
            operation="transfer.export", params={}, body=body, identity_id=identity,
            fn=partial(export_done, result=result, now=ctx.now()))
        return outcome.result

    def manifest_of(digest: str) -> transfer_archive.Manifest:
        path = artifacts.path(digest)
        try:
            with open(path, "rb") as f:
                return transfer_archive.read_manifest(f)
        except FileNotFoundError:
            raise FailedPrecondition(
                f"artifact {digest} is not in ctrl's artifact store (export a Volume with "
                "`kibo transfer export`, or upload the archive first)",
                details={"digest": digest}) from None

    async def import_(request: Request, caller: Caller | None) -> dict[str, Any]:
        body = await read_body(request, TransferImportIn)
        identity = caller.identity_id if caller is not None else None
        service.require_running()
        replay = await journal.lookup(operation="transfer.import", params={}, body=body)
        if replay is not None:
            return replay.result
        digest = body.artifact_digest
        try:
            manifest = await trio.to_thread.run_sync(manifest_of, digest)
            if manifest.kind != use_rights.VOLUME:
                raise FailedPrecondition(
                    f"artifact {digest} holds a {manifest.kind} ({manifest.object_id}), "
                    "not a Volume", details={"digest": digest, "kind": manifest.kind})
            capacity = manifest.capacity_bytes
            if capacity < MIN_VOLUME_BYTES or capacity % (1 << 20):
                raise FailedPrecondition(f"artifact {digest} holds a block file of "
                                         f"{capacity} bytes: not a Volume's capacity")
            service.watch.drain()
            pool_id = body.pool_id or volumes._default_pool()
            nodes = volumes.usable_nodes([pool_id], drained_ok=False)
            if not nodes:
                raise FailedPrecondition(
                    f"no live node attached to pool {pool_id} can import the Volume "
                    "(nodes must be connected, not drained, and report the pool available)",
                    details={"pool_id": pool_id})
            await store.run(partial(pool_capacity.check_room, pool_id=pool_id,
                                    add_bytes=capacity, what="Volume", now=ctx.now(),
                                    default_capacity=volumes.default_capacity))
        except STORED_ERRORS as exc:
            await journal.refuse(operation="transfer.import", params={}, body=body,
                                 identity_id=identity, exc=exc)
            raise  # pragma: no cover - refuse always raises
        node_id = nodes[0]
        volume_id = import_volume_id(identity, body.command_id)
        exists = await store.run(lambda s: s.get(Volume, volume_id) is not None)
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
            fn=partial(record_import, volume_id=volume_id, pool_id=pool_id,
                       shared=volumes.pool_shared(node_id, pool_id),
                       capacity_bytes=capacity, labels=body.labels, node_id=node_id,
                       digest=digest, source=manifest.object_id, now=ctx.now(),
                       default_capacity=volumes.default_capacity))
        volumes.changed()
        return outcome.result

    return [
        Route("POST", "/v1/transfers/export", export, "operator",
              "Export a Volume as a Transfer archive into the artifact store (answers "
              "when the archive is stored)", body=TransferExportIn,
              result=TransferExportOut),
        Route("POST", "/v1/transfers/import", import_, "operator",
              "Import a Transfer archive from the artifact store as a new Volume "
              "(answers when it is AVAILABLE)", body=TransferImportIn,
              result=TransferImportOut),
    ]
