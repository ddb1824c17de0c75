"""ctrl's artifact store: content-addressed blobs (Template images, kernels, initramfs).

A blob lives at ``<root>/sha256/<hex>``, where `root` is ``ctrl.artifact_dir`` or
``<state_dir>/artifacts``, and its name *is* its sha256: a file is either complete and
correct or absent.  An upload streams into a temporary file beside the target
(``.<hex>-<n>.tmp``), hashing as it goes; only when the digest matches the one the
caller named is the file fsynced and renamed into place, so a short or corrupt upload
writes nothing that anyone will read.  Uploading a blob that already exists is
harmless: the body is hashed (a wrong one is still refused) and nothing is written.

Images are hundreds of MB, so nothing here holds a whole blob in memory: uploads are
written in pieces of `WRITE_BATCH` bytes from a worker thread (zero runs left as holes:
an image stays sparse), downloads are served from the file by `BlobResponse`.
Temporary files of uploads that a crash cut short are removed when the store is opened.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import AsyncIterable
from dataclasses import dataclass
from pathlib import Path

import trio
from starlette.datastructures import Headers
from starlette.responses import (
    FileResponse,
    JSONResponse,
    MalformedRangeHeader,
    RangeNotSatisfiable,
    Response,
)
from starlette.types import Receive, Scope, Send

from kibotos.config import CtrlConfig
from kibotos.core import atomicfile, ids
from kibotos.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kibotos.pieces import write_in_pieces

#: Bytes gathered from the request before one write (and hash update) in a thread.
WRITE_BATCH = 1 << 20
#: Temporary files older than this are leftovers of a crashed upload.
STALE_TEMPORARY_S = 3600.0


@dataclass(frozen=True)
class PutResult:
    digest: str  # sha256:<hex>
    size: int
    created: bool  # False when the blob was already there


class BlobResponse(FileResponse):
    """A blob download: the file in 1 MiB pieces (starlette's default is 64 KiB, one
    thread hop each), with HEAD and byte ranges as `FileResponse` serves them, except
    that a bad ``Range`` is answered in the API's error envelope (starlette answers it
    in plain text): 400 for a malformed one, 416 with ``Content-Range`` for one past
    the end, both ``invalid_argument``."""

    chunk_size = WRITE_BATCH

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._range_refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def _range_refusal(self, scope: Scope) -> Response | None:
        """The error answer to the request's ``Range``, when `FileResponse` would
        refuse it (the same parser decides), else None."""
        headers = Headers(scope=scope)
        http_range = headers.get("range")
        if (http_range is None or self.stat_result is None
                or str(scope.get("method", "GET")).upper() not in ("GET", "HEAD")):
            return None
        if_range = headers.get("if-range")
        if if_range is not None and not self._should_use_range(if_range):
            return None  # the whole blob is sent: no range to refuse
        size = self.stat_result.st_size
        try:
            self._parse_range_header(http_range, size)
        except MalformedRangeHeader as exc:
            error = InvalidArgument(f"invalid Range header: {exc.content}",
                                    details={"range": http_range[:200]})
            return JSONResponse(error.to_wire(), status_code=400)
        except RangeNotSatisfiable:
            error = InvalidArgument(f"Range {http_range[:80]!r} is outside the blob of "
                                    f"{size} bytes", details={"size": size})
            return JSONResponse(error.to_wire(), status_code=416,
                                headers={"Content-Range": f"bytes */{size}"})
        return None


def artifact_root(config: CtrlConfig) -> Path:
    section = config.ctrl
    return Path(section.artifact_dir) if section.artifact_dir else (
        Path(section.state_dir) / "artifacts")


class ArtifactStore:
    """The blobs under `root`; every method takes a digest as ``sha256:<hex>`` or hex."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "sha256"

    def prepare(self) -> None:
        """Create the directory and remove leftovers of uploads a crash interrupted.
        Only old ones: another ctrl process sharing the directory may be uploading."""
        try:
            self.blobs.mkdir(parents=True, exist_ok=True, mode=0o755)
        except OSError as exc:
            raise FailedPrecondition(
                f"create artifact directory {self.blobs}: {exc.strerror}") from None
        cutoff = time.time() - STALE_TEMPORARY_S
        for entry in os.scandir(self.blobs):
            if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                try:
                    if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                        os.unlink(entry.path)
                except FileNotFoundError:
                    pass

    def path(self, digest: str) -> Path:
        return self.blobs / ids.digest_hex(digest)

    def size(self, digest: str) -> int | None:
        """The blob's size in bytes, or None when the store does not have it."""
        try:
            st = self.path(digest).stat()
        except FileNotFoundError:
            return None
        return st.st_size

    def read_head(self, digest: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` of a blob (for format checks); short at the end."""
        with open(self.path(digest), "rb") as f:
            f.seek(offset)
            return f.read(length)

    def response(self, digest: str) -> BlobResponse:
        path = self.path(digest)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise NotFound(f"artifact {ids.check_digest(digest)} does not exist",
                           details={"digest": ids.check_digest(digest)}) from None
        return BlobResponse(path, stat_result=st, media_type="application/octet-stream",
                            headers={"x-kibotos-digest": ids.check_digest(digest),
                                     "cache-control": "public, max-age=31536000, immutable"})

    async def put(self, digest: str, chunks: AsyncIterable[bytes]) -> PutResult:
        """Store the bytes of `chunks` as the blob `digest`, after checking they hash
        to it; a mismatch raises `InvalidArgument` and leaves nothing behind."""
        hexdigest = ids.digest_hex(digest)
        target = self.blobs / hexdigest
        exists = await trio.to_thread.run_sync(target.is_file)
        writer = _Writer(None if exists else target)
        try:
            await trio.to_thread.run_sync(writer.open)
            await write_in_pieces(chunks, writer.write, WRITE_BATCH)
            got = writer.hash.hexdigest()
            if got != hexdigest:
                raise InvalidArgument(
                    f"upload does not match its digest: the body's sha256 is {got}, the "
                    f"path names {hexdigest} ({writer.size} bytes received); nothing was "
                    "stored",
                    details={"expected": f"sha256:{hexdigest}", "actual": f"sha256:{got}",
                             "size": writer.size})
            await trio.to_thread.run_sync(writer.commit)
        finally:
            writer.discard()  # close + unlink: quick, and must run when cancelled too
        return PutResult(f"sha256:{hexdigest}", writer.size, created=not exists)


class _Writer:
    """The temporary file of one upload (none when the blob exists: hash only)."""

    def __init__(self, target: Path | None) -> None:
        self.target = target
        self.file: atomicfile.SparseFile | None = None
        self.hash = hashlib.sha256()
        self.size = 0

    def open(self) -> None:
        if self.target is None:
            return
        try:
            self.file = atomicfile.SparseFile(self.target)
        except OSError as exc:
            raise FailedPrecondition(
                f"store artifact: create {self.target.parent}: {exc.strerror}") from None

    def write(self, data: bytes) -> None:
        self.hash.update(data)
        self.size += len(data)
        if self.file is None:
            return
        try:
            self.file.write(data)
        except OSError as exc:
            raise FailedPrecondition(f"store artifact: write {self.file.tmp}: "
                                     f"{exc.strerror}") from None

    def commit(self) -> None:
        if self.file is not None:
            self.file.commit()

    def discard(self) -> None:
        """Close and remove the temporary file unless `commit` renamed it."""
        if self.file is not None:
            self.file.discard()
