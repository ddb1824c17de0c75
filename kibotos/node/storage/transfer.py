"""``object.export`` and ``object.import``: a Volume or retained layer as a Transfer
archive in ctrl's artifact store (spec: storage-pools-on-nfs, "Directory layout":
staging files under ``transfer-staging/``, deleted when the command ends; the archive
itself is kept by ctrl, so an import can run on any node attached to the target pool).

Export (``{kind, pool_id, object_id, epoch}`` → ``{artifact_digest, size}``): the object
is opened at the command's epoch (the takeover table applies, so nobody writes it while
it is read), packed (`kibotos.transfer_archive`) into
``<pool>/volumes/transfer-staging/.<node_id>.export-<n>.tar``, released cleanly, then
uploaded (``PUT /v1/artifacts/sha256/<hex>`` with the node's credential; ctrl checks the
digest).  The archive is deterministic, so a retried export is the same artifact.

Import (``{kind, pool_id, object_id, artifact_digest, epoch}`` → ``{imported: true}``):
the artifact is downloaded into ``transfer-staging/.<node_id>.download-import-<n>.tar``
(checked against its digest), unpacked into ``data/.<node_id>.import-<n>.tmp`` (sparse,
handed to the VMM identity, fsynced), then the node takes the use right at the epoch
(holder record first; a newer holder refuses), renames the block file into place, writes
the metadata (the archive's, with this pool and ``imported_from``) and releases it
cleanly, so any node attached to the pool opens it at that epoch or newer.  A repeat is
answered from the metadata; another object already under that ID is
``already_exists``.  The temporary names start with the node ID, so a crash leaves files
the start removes (`kibotos.node.storage.pools.tempfiles`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import secrets
import ssl
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import trio

from kibotos import transfer_archive
from kibotos.core import atomicfile, ids
from kibotos.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    NotFound,
    Unavailable,
)
from kibotos.core.logs import EventLogger
from kibotos.node.session.ctrl_http import CtrlUrls, refusal
from kibotos.node.storage.objects import (
    RETAINED_LAYERS,
    VOLUMES,
    Holder,
    PoolObjects,
    UseRightTakenOver,
)
from kibotos.node.storage.pools.dirs import hand_block_file
from kibotos.tls.contexts import client_context

log = EventLogger()

KIND_DIRS = {"volume": VOLUMES, "retained_layer": RETAINED_LAYERS}
STAGING = ("volumes", "transfer-staging")
PIECE = 1 << 20
Key = tuple[str, str, str]  # (pool subdirectory, pool ID, object ID)
#: Refuses (raising) while something else uses the object, else marks it busy for the
#: duration (the Instance manager's storage guard); `doing` is e.g. "exported".
Guard = Callable[[str, Key], contextlib.AbstractContextManager[None]]


def _create(path: Path) -> BinaryIO:
    return open(path, "xb")


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _rand() -> int:
    return secrets.randbelow(2**32)


@contextlib.contextmanager
def _no_guard(doing: str, key: Key) -> Iterator[None]:
    yield


class NodeTransfers:
    """Export and import on this node.  `pool(pool_id, subdir)` finds a configured
    pool's objects (refusing others), `credential` is the node's bearer credential for
    ctrl's artifact store, `guard` the Instance manager's storage guard, `held` is told
    of an object whose holder record now names this node (for ``volume_count``)."""

    def __init__(self, *, node_id: str, pool: Callable[[str, str], PoolObjects],
                 ctrl_url: str | Sequence[str], credential: Callable[[], str | None],
                 guard: Guard | None = None, held: Callable[[Key], None] | None = None,
                 http: httpx.AsyncClient | None = None, timeout: float = 600.0,
                 verify: ssl.SSLContext | None = None) -> None:
        self.node_id = node_id
        #: Checks ctrl's certificate (``[node] ctrl_ca_file``; default the system store).
        self.verify = verify or client_context()
        self.pool = pool
        #: ctrl's replicas (``[node] ctrl_url``): a transfer that cannot reach one goes
        #: to the next when it is retried.
        self.urls = CtrlUrls(ctrl_url)
        self.credential = credential
        self.guard = guard or _no_guard
        self.held = held or (lambda key: None)
        self._http = http
        self._timeout = timeout

    # ------------------------------------------------------------------ HTTP

    @contextlib.asynccontextmanager
    async def _client(self) -> AsyncIterator[httpx.AsyncClient]:
        """The injected client, or one for this command (transfers are rare and long:
        nothing is gained by keeping connections open between them)."""
        if self._http is not None:
            yield self._http
            return
        async with httpx.AsyncClient(
                timeout=httpx.Timeout(self._timeout, connect=30), verify=self.verify) as client:
            yield client

    def _headers(self) -> dict[str, str]:
        cred = self.credential()
        return {"Authorization": f"Bearer {cred}"} if cred else {}

    @property
    def ctrl_url(self) -> str:
        return self.urls.current

    @staticmethod
    def _url(base: str, digest: str) -> str:
        return f"{base}/v1/artifacts/sha256/{ids.digest_hex(digest)}"

    async def _upload(self, path: Path, digest: str, size: int) -> None:
        async def body() -> AsyncIterator[bytes]:
            f = await trio.to_thread.run_sync(open, path, "rb")
            try:
                while chunk := await trio.to_thread.run_sync(f.read, PIECE):
                    yield chunk
            finally:
                f.close()

        base = self.ctrl_url
        try:
            async with self._client() as client:
                resp = await client.put(
                    self._url(base, digest), content=body(),
                    headers={**self._headers(), "content-type": "application/octet-stream",
                             "content-length": str(size)})
        except httpx.TransportError as exc:
            self.urls.failed(base)
            raise Unavailable(f"upload Transfer archive {digest}: cannot reach ctrl at "
                              f"{base}: {exc or type(exc).__name__}") from None
        if resp.status_code != 200:
            raise refusal(resp, f"upload Transfer archive {digest}")

    async def _download(self, digest: str, path: Path) -> int:
        """Stream the artifact into `path` (a new file), checking its digest."""
        hexdigest = ids.digest_hex(digest)
        hasher = hashlib.sha256()
        size = 0
        base = self.ctrl_url
        try:
            async with self._client() as client, \
                    client.stream("GET", self._url(base, digest),
                                  headers=self._headers()) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    err = refusal(resp, f"download Transfer archive {digest}")
                    if isinstance(err, NotFound):
                        raise FailedPrecondition(
                            f"artifact {digest} is not in ctrl's artifact store",
                            details={"reason": "artifact_missing", "digest": digest})
                    raise err
                f = await trio.to_thread.run_sync(_create, path)
                try:
                    async for chunk in resp.aiter_raw(PIECE):
                        hasher.update(chunk)
                        size += len(chunk)
                        await trio.to_thread.run_sync(f.write, chunk)
                finally:
                    f.close()
        except httpx.TransportError as exc:
            self.urls.failed(base)
            raise Unavailable(f"download Transfer archive {digest}: cannot reach ctrl at "
                              f"{base}: {exc or type(exc).__name__}") from None
        if hasher.hexdigest() != hexdigest:
            raise Unavailable(f"download Transfer archive {digest}: the {size} bytes ctrl "
                              f"sent hash to sha256:{hasher.hexdigest()}; retry")
        return size

    # ------------------------------------------------------------------ export

    def _objects(self, kind: str, pool_id: str) -> PoolObjects:
        return self.pool(pool_id, KIND_DIRS[kind])

    @staticmethod
    def staging(objs: PoolObjects) -> Path:
        return objs.root.parent.joinpath(*STAGING)

    async def export(self, kind: str, pool_id: str, object_id: str, epoch: int
                     ) -> dict[str, Any]:
        objs = self._objects(kind, pool_id)
        run = trio.to_thread.run_sync
        objs.check_available()
        staged = self.staging(objs) / f".{self.node_id}.export-{_rand()}.tar"
        try:
            with self.guard("exported", (objs.kind, pool_id, object_id)):
                await objs.settle_names(object_id, epoch)
                if not await run(objs.data_path(object_id).is_file):
                    raise NotFound(f"{objs.label} {object_id} does not exist in pool "
                                   f"{pool_id}")
                opened = await objs.open(object_id, epoch)
                try:
                    packed = await run(self._pack, objs, object_id, opened.path, staged,
                                       epoch)
                finally:
                    with trio.CancelScope(shield=True):
                        await run(functools.partial(objs.release, object_id, epoch,
                                                    confirmed_on_disk=True))
            self.held((objs.kind, pool_id, object_id))
            await self._upload(staged, packed.digest, packed.size)
        finally:
            with trio.CancelScope(shield=True):
                await run(functools.partial(staged.unlink, missing_ok=True))
        log.info("storage object exported", kind=kind, pool=pool_id, object=object_id,
                 epoch=epoch, artifact=packed.digest, size=packed.size,
                 data_bytes=packed.manifest.data_bytes)
        return {"artifact_digest": packed.digest, "size": packed.size}

    @staticmethod
    def _pack(objs: PoolObjects, object_id: str, block: Path, staged: Path, epoch: int
              ) -> transfer_archive.Packed:
        meta = objs.metadata(object_id) or {}
        kind = next(k for k, v in KIND_DIRS.items() if v == objs.kind)
        with open(staged, "xb") as out:
            packed = transfer_archive.pack(block, meta, out, kind=kind, object_id=object_id,
                                           source={"pool_id": objs.pool_id, "epoch": epoch})
        # A newer epoch taken while the file was read (a start elsewhere after ctrl
        # granted it again): the archive may hold half of that node's writes.
        successor = objs.taken_over(object_id, epoch)
        if successor is not None:
            raise UseRightTakenOver(
                f"{objs.label} {object_id} in pool {objs.pool_id}: the use right was taken "
                f"over by node {successor.node_id} at epoch {successor.epoch} while it was "
                "being exported; nothing was uploaded",
                details={"reason": "use_right_taken_over", "holder_epoch": successor.epoch})
        return packed

    # ------------------------------------------------------------------ import

    async def import_(self, kind: str, pool_id: str, object_id: str, artifact_digest: str,
                      epoch: int) -> dict[str, Any]:
        digest = ids.check_digest(artifact_digest)
        objs = self._objects(kind, pool_id)
        run = trio.to_thread.run_sync
        objs.check_available()
        staged = self.staging(objs) / f".{self.node_id}.download-import-{_rand()}.tar"
        block = objs.root / "data" / f".{self.node_id}.import-{_rand()}.tmp"
        with self.guard("imported", (objs.kind, pool_id, object_id)):
            if await run(self._imported_already, objs, object_id, digest):
                return {"imported": True}
            try:
                size = await self._download(digest, staged)
                manifest = await run(self._unpack, objs, staged, block, kind)
                await run(self._install, objs, object_id, epoch, block, manifest, digest)
                await run(functools.partial(objs.release, object_id, epoch,
                                            confirmed_on_disk=True))
                self.held((objs.kind, pool_id, object_id))
            finally:
                with trio.CancelScope(shield=True):
                    await run(functools.partial(staged.unlink, missing_ok=True))
                    await run(functools.partial(block.unlink, missing_ok=True))
        log.info("storage object imported", kind=kind, pool=pool_id, object=object_id,
                 epoch=epoch, artifact=digest, size=size, source=manifest.object_id)
        return {"imported": True}

    @staticmethod
    def _imported_already(objs: PoolObjects, object_id: str, digest: str) -> bool:
        """True when this import is done; False when it is to be made or finished;
        `AlreadyExists` when another object has the ID."""
        meta = objs.metadata(object_id)
        if meta is None and not objs.data_path(object_id).exists():
            return False
        source = (meta or {}).get("imported_from")
        if not isinstance(source, dict) or source.get("artifact_digest") != digest:
            raise AlreadyExists(
                f"{objs.label} {object_id} already exists in pool {objs.pool_id}"
                + ("" if meta is None else " (not an import of " + digest + ")"),
                details={"object_id": object_id, "pool_id": objs.pool_id})
        assert meta is not None
        if not objs.data_path(object_id).is_file():
            return False
        # finished = released at the import's epoch, or used by a holder since
        return meta.get("state") == "released" or \
            meta.get("epoch") != source.get("target_epoch") or \
            meta.get("holder") != objs.node_id

    def _unpack(self, objs: PoolObjects, staged: Path, block: Path, kind: str
                ) -> transfer_archive.Manifest:
        fd = os.open(block, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with open(staged, "rb") as archive:
                manifest = transfer_archive.unpack(archive, fd, expect_kind=kind)
        finally:
            os.close(fd)
        hand_block_file(block, objs.kind)  # root:kibotos-vmm 0660 before it has a name
        return manifest

    def _install(self, objs: PoolObjects, object_id: str, epoch: int, block: Path,
                 manifest: transfer_archive.Manifest, digest: str) -> None:
        """Use right (holder record first), block file under its name, metadata."""
        with objs.locked(object_id):
            if objs._decide(object_id, epoch) is not None:
                objs._write("holders", object_id, {"node_id": self.node_id, "epoch": epoch,
                                                   "at": _now()})
            if objs.holder(object_id) != Holder(self.node_id, epoch):
                raise UseRightTakenOver(f"{objs.label} {object_id} in pool {objs.pool_id}: "
                                        "the use right was taken over during the import",
                                        details={"reason": "use_right_taken_over"})
            target = objs.data_path(object_id)
            os.replace(block, target)
            atomicfile.fsync_dir(target.parent)
            now = _now()
            meta: dict[str, Any] = dict(manifest.metadata)
            meta.update(version=1, kind=objs.kind, id=object_id, pool_id=objs.pool_id,
                        capacity_bytes=manifest.capacity_bytes, state="attached",
                        holder=self.node_id, epoch=epoch, attached_at=now,
                        released_cleanly=True,
                        imported_from={"artifact_digest": digest, "target_epoch": epoch,
                                       "object_id": manifest.object_id,
                                       "pool_id": manifest.source.get("pool_id"),
                                       "epoch": manifest.source.get("epoch"), "at": now})
            objs._write("metadata", object_id, meta)
