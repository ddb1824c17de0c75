"""The Transfer archive: one Volume or retained layer as a single file (docs/storage.md,
"Transfer archives").

A zstd-compressed tar stream (POSIX pax, zstd frame with its content checksum) of two
members, in this order::

    kibotos-transfer.json   the manifest (below)
    data                    the data extents of the block file, concatenated

Block files are sparse and mostly holes, so the archive carries only the byte ranges the
file system reports as data (``SEEK_DATA``/``SEEK_HOLE``); the manifest lists them, and
unpacking writes each at its offset into a new file truncated to the capacity, zero
pieces left as holes, so the imported block file is sparse again.  The manifest::

    {"format": "kibotos-transfer", "version": 1,
     "kind": "volume" | "retained_layer", "object_id": "vol-…",
     "capacity_bytes": <the block file's length>,
     "extents": [[offset, length], …], "data_bytes": <sum of the lengths>,
     "metadata": {<the object's metadata record without what describes one holder's use>},
     "source": {"pool_id": "…", "epoch": N}}

It is deterministic: the same block file and metadata at the same epoch give the same
bytes (no times, owners or random names inside), so a retried export is the same
artifact.  Unpacking checks everything before trusting it (member names and order,
manifest shape, extents sorted, in bounds and adding up to the data member) and refuses
anything else as ``invalid_argument``.

Everything here is blocking (call it from a worker thread).  The node packs and unpacks
(`kibotos.node.storage.transfer`); ctrl reads only the manifest, to check an import.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

import zstandard

from kibotos.core import atomicfile
from kibotos.core.errors import InvalidArgument

FORMAT = "kibotos-transfer"
VERSION = 1
MANIFEST = "kibotos-transfer.json"
DATA = "data"
KINDS = ("volume", "retained_layer")
#: Metadata keys that describe one holder's use of the object, not the object.
PER_HOLDER = frozenset({"state", "holder", "epoch", "attached_at", "released_at",
                        "handoff_clean", "confirmed_on_disk", "released_cleanly", "pool_id"})
PIECE = 1 << 20
ZSTD_LEVEL = 3
#: A manifest larger than this is not one of ours (extents of a very fragmented
#: multi-TiB file still fit).
MANIFEST_LIMIT = 64 << 20


def data_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    """The (offset, length) ranges of `fd` that hold data, by SEEK_DATA/SEEK_HOLE."""
    ranges: list[tuple[int, int]] = []
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole remains
                break
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end > start:
            ranges.append((start, end - start))
        offset = end
    return ranges


def portable_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a metadata record that travels with the object."""
    return {k: v for k, v in metadata.items() if k not in PER_HOLDER}


@dataclass(frozen=True)
class Manifest:
    kind: str
    object_id: str
    capacity_bytes: int
    extents: tuple[tuple[int, int], ...]
    metadata: dict[str, Any]
    source: dict[str, Any]

    @property
    def data_bytes(self) -> int:
        return sum(length for _, length in self.extents)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "kind": self.kind,
                "object_id": self.object_id, "capacity_bytes": self.capacity_bytes,
                "extents": [list(e) for e in self.extents], "data_bytes": self.data_bytes,
                "metadata": self.metadata, "source": self.source}

    @classmethod
    def from_json(cls, value: Any) -> Manifest:
        def bad(why: str) -> InvalidArgument:
            return InvalidArgument(f"not a kibotos Transfer archive: manifest {why}")

        if not isinstance(value, dict) or value.get("format") != FORMAT:
            raise bad(f"format is not {FORMAT!r}")
        if value.get("version") != VERSION:
            raise bad(f"version {value.get('version')!r} is not {VERSION} (made by another "
                      "kibotos version?)")
        kind, object_id = value.get("kind"), value.get("object_id")
        capacity, extents = value.get("capacity_bytes"), value.get("extents")
        metadata, source = value.get("metadata"), value.get("source")
        if kind not in KINDS:
            raise bad(f"kind {kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(object_id, str) or not object_id:
            raise bad("has no object_id")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise bad(f"capacity_bytes {capacity!r} is not a positive integer")
        if not isinstance(metadata, dict) or not isinstance(source, dict):
            raise bad("metadata and source must be objects")
        if not isinstance(extents, list):
            raise bad("extents must be a list")
        out: list[tuple[int, int]] = []
        end = 0
        for item in extents:
            if not (isinstance(item, list) and len(item) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
                raise bad(f"extent {item!r} is not [offset, length]")
            offset, length = item
            if offset < end or length <= 0 or offset + length > capacity:
                raise bad(f"extent {item!r} overlaps, is empty, or lies beyond "
                          f"capacity_bytes {capacity}")
            out.append((offset, length))
            end = offset + length
        manifest = cls(kind, object_id, capacity, tuple(out), metadata, source)
        if value.get("data_bytes") != manifest.data_bytes:
            raise bad(f"data_bytes {value.get('data_bytes')!r} is not the sum of the "
                      f"extents ({manifest.data_bytes})")
        return manifest


class _ExtentReader:
    """The data extents of a block file, read one after the other as one stream;
    `read(n)` returns exactly n bytes until the end (what tarfile's copy expects)."""

    def __init__(self, fd: int, extents: tuple[tuple[int, int], ...]) -> None:
        self.fd = fd
        self.pending = list(extents)

    def read(self, size: int = -1) -> bytes:
        out = bytearray()
        while self.pending and (size < 0 or len(out) < size):
            offset, length = self.pending[0]
            want = length if size < 0 else min(size - len(out), length)
            data = os.pread(self.fd, want, offset)
            if not data:
                raise OSError(errno.EIO, f"block file ended inside extent {offset}+{length} "
                              "(it shrank while being read?)")
            out += data
            if len(data) == length:
                self.pending.pop(0)
            else:
                self.pending[0] = (offset + len(data), length - len(data))
        return bytes(out)


class _HashingWriter(io.RawIOBase):
    """Writes to `out`, keeping the sha256 and size of everything written."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.hash = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.out.write(view)
        self.hash.update(view)
        self.size += len(view)
        return len(view)


@dataclass(frozen=True)
class Packed:
    digest: str  # sha256:<hex> of the archive file
    size: int
    manifest: Manifest


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o600
    info.mtime = 0
    info.uname = info.gname = ""
    return info


def pack(block_file: Path, metadata: Mapping[str, Any], out: BinaryIO, *, kind: str,
         object_id: str, source: Mapping[str, Any]) -> Packed:
    """Write the archive of `block_file` and `metadata` to `out` (not closed)."""
    if kind not in KINDS:
        raise InvalidArgument(f"unknown object kind {kind!r}")
    fd = os.open(block_file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        manifest = Manifest(kind, object_id, size, tuple(data_ranges(fd, size)),
                            portable_metadata(metadata), dict(source))
        body = json.dumps(manifest.to_json(), sort_keys=True, separators=(",", ":")).encode()
        sink = _HashingWriter(out)
        cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
        with cctx.stream_writer(cast(IO[bytes], sink), closefd=False) as zw, \
                tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            # tarfile copies a member in pieces of this size (default 16 KiB)
            setattr(tar, "copybufsize", PIECE)  # noqa: B010 (not in typeshed)
            tar.addfile(_member(MANIFEST, len(body)), io.BytesIO(body))
            tar.addfile(_member(DATA, manifest.data_bytes),
                        cast(IO[bytes], _ExtentReader(fd, manifest.extents)))
    finally:
        os.close(fd)
    return Packed(f"sha256:{sink.hash.hexdigest()}", sink.size, manifest)


def _next(tar: tarfile.TarFile, name: str) -> tarfile.TarInfo:
    member = tar.next()
    if member is None or member.name != name or not member.isfile():
        got = "the end" if member is None else repr(member.name)
        raise InvalidArgument(f"not a kibotos Transfer archive: expected member {name!r}, "
                              f"found {got}")
    return member


def _read_exact(src: IO[bytes], n: int) -> bytes:
    data = src.read(n)
    if len(data) != n:
        raise InvalidArgument("not a kibotos Transfer archive: the data member ended early")
    return data


_DAMAGED = (tarfile.TarError, zstandard.ZstdError, EOFError)


def read_manifest(archive: BinaryIO) -> Manifest:
    """Only the manifest (the first member): cheap, for checks before an import."""
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(archive, closefd=False)
        with tarfile.open(fileobj=reader, mode="r|") as tar:
            return _manifest(tar)
    except _DAMAGED as exc:
        raise InvalidArgument(f"not a kibotos Transfer archive: {exc}") from None


def _manifest(tar: tarfile.TarFile) -> Manifest:
    member = _next(tar, MANIFEST)
    if member.size > MANIFEST_LIMIT:
        raise InvalidArgument(f"not a kibotos Transfer archive: manifest of {member.size} "
                              "bytes")
    src = tar.extractfile(member)
    assert src is not None
    try:
        value = json.loads(_read_exact(src, member.size))
    except ValueError as exc:
        raise InvalidArgument(f"not a kibotos Transfer archive: manifest is not JSON: "
                              f"{exc}") from None
    return Manifest.from_json(value)


def unpack(archive: BinaryIO, fd_out: int, *, expect_kind: str | None = None) -> Manifest:
    """Write the block file of `archive` into `fd_out` (a new, empty file): every extent
    at its offset, zero pieces as holes, then truncated to the capacity and fsynced.
    Returns the manifest (its metadata is for the caller to record)."""
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(archive, closefd=False)
        with tarfile.open(fileobj=reader, mode="r|") as tar:
            manifest = _manifest(tar)
            if expect_kind is not None and manifest.kind != expect_kind:
                raise InvalidArgument(f"the archive holds a {manifest.kind} "
                                      f"({manifest.object_id}), not a {expect_kind}")
            member = _next(tar, DATA)
            if member.size != manifest.data_bytes:
                raise InvalidArgument(f"not a kibotos Transfer archive: data member has "
                                      f"{member.size} bytes, the extents "
                                      f"{manifest.data_bytes}")
            src = tar.extractfile(member)
            assert src is not None
            for offset, length in manifest.extents:
                os.lseek(fd_out, offset, os.SEEK_SET)
                while length:
                    data = _read_exact(src, min(PIECE, length))
                    atomicfile.write_sparse(fd_out, data)
                    length -= len(data)
            extra = tar.next()
            if extra is not None:
                raise InvalidArgument(f"not a kibotos Transfer archive: unexpected member "
                                      f"{extra.name!r}")
            # the zstd frame's checksum is verified when its end is read
            while reader.read(PIECE):
                pass
    except _DAMAGED as exc:
        raise InvalidArgument(f"not a kibotos Transfer archive (or a damaged one): "
                              f"{exc}") from None
    os.ftruncate(fd_out, manifest.capacity_bytes)
    os.fsync(fd_out)
    return manifest
