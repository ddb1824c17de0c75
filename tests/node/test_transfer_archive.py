"""The Transfer archive format (kibotos.transfer_archive): sparse round trip,
determinism, and refusal of anything that is not a whole archive of ours."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
import zstandard

from kibotos import transfer_archive as ta
from kibotos.core.errors import InvalidArgument

MIB = 1 << 20


def sparse_file(path: Path, size: int = 64 * MIB) -> dict[int, bytes]:
    """A file of `size` with a few data pieces and holes; returns offset → bytes."""
    pieces = {0: b"superblock" * 100, 5 * MIB: os.urandom(300_000),
              40 * MIB + 4096: b"\x00" * 8192 + b"tail-data", size - 4096: b"end" * 10}
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, data in pieces.items():
            f.seek(offset)
            f.write(data)
    return pieces


META = {"version": 1, "kind": "volumes", "id": "vol-1", "pool_id": "pool-a",
        "capacity_bytes": 64 * MIB, "state": "attached", "holder": "node-a", "epoch": 4,
        "attached_at": "2026-01-01T00:00:00+00:00", "created_with": {"capacity_bytes": 1}}


def pack(src: Path, meta: dict | None = None) -> tuple[bytes, ta.Packed]:
    out = io.BytesIO()
    packed = ta.pack(src, meta or META, out, kind="volume", object_id="vol-1",
                     source={"pool_id": "pool-a", "epoch": 4})
    return out.getvalue(), packed


def test_round_trip_keeps_data_and_holes(tmp_path: Path):
    src, dst = tmp_path / "src.ext4", tmp_path / "dst.ext4"
    sparse_file(src)
    blob, packed = pack(src)
    assert packed.size == len(blob)
    assert packed.manifest.capacity_bytes == 64 * MIB
    assert packed.manifest.data_bytes < 2 * MIB  # holes were not carried
    assert len(blob) < MIB
    fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        manifest = ta.unpack(io.BytesIO(blob), fd, expect_kind="volume")
    finally:
        os.close(fd)
    assert dst.read_bytes() == src.read_bytes()
    assert os.stat(dst).st_blocks * 512 < 4 * MIB  # sparse again
    # only what describes the object travels, not one holder's use of it
    assert manifest.metadata == {"version": 1, "kind": "volumes", "id": "vol-1",
                                 "capacity_bytes": 64 * MIB,
                                 "created_with": {"capacity_bytes": 1}}
    assert manifest.source == {"pool_id": "pool-a", "epoch": 4}


def test_the_archive_is_a_zstd_tar_an_operator_can_read(tmp_path: Path):
    src = tmp_path / "src.ext4"
    sparse_file(src)
    blob, packed = pack(src)
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)).read()
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        assert tar.getnames() == ["kibotos-transfer.json", "data"]
        manifest = json.loads(tar.extractfile("kibotos-transfer.json").read())
    assert manifest["format"] == "kibotos-transfer"
    assert manifest["extents"] == [list(e) for e in packed.manifest.extents]
    assert ta.read_manifest(io.BytesIO(blob)) == packed.manifest


def test_same_object_gives_the_same_artifact(tmp_path: Path):
    src = tmp_path / "src.ext4"
    sparse_file(src)
    first, a = pack(src)
    second, b = pack(src, {**META, "attached_at": "2027-01-01", "holder": "node-b"})
    assert a.digest == b.digest
    assert first == second


def test_empty_block_file_is_all_hole(tmp_path: Path):
    src, dst = tmp_path / "src.ext4", tmp_path / "dst.ext4"
    with open(src, "wb") as f:
        f.truncate(16 * MIB)
    blob, packed = pack(src)
    assert packed.manifest.extents == ()
    fd = os.open(dst, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        ta.unpack(io.BytesIO(blob), fd)
    finally:
        os.close(fd)
    assert dst.stat().st_size == 16 * MIB
    assert dst.stat().st_blocks == 0


def _unpack(blob: bytes, tmp_path: Path, **kw) -> None:
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        ta.unpack(io.BytesIO(blob), fd, **kw)
    finally:
        os.close(fd)


def _archive(members: list[tuple[str, bytes]]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return zstandard.ZstdCompressor(write_checksum=True).compress(raw.getvalue())


def _manifest(**changes) -> bytes:
    value = {"format": "kibotos-transfer", "version": 1, "kind": "volume",
             "object_id": "vol-1", "capacity_bytes": MIB, "extents": [[0, 4]],
             "data_bytes": 4, "metadata": {}, "source": {}}
    value.update(changes)
    return json.dumps(value).encode()


@pytest.mark.parametrize(("blob", "needle"), [
    (b"not zstd at all", "not a kibotos Transfer archive"),
    (_archive([("data", b"abcd")]), "expected member 'kibotos-transfer.json'"),
    (_archive([("kibotos-transfer.json", b"{")]), "manifest is not JSON"),
    (_archive([("kibotos-transfer.json", _manifest(version=2)), ("data", b"abcd")]),
     "version 2"),
    (_archive([("kibotos-transfer.json", _manifest(kind="disk")), ("data", b"abcd")]),
     "kind 'disk'"),
    (_archive([("kibotos-transfer.json", _manifest(extents=[[MIB - 2, 4]])),
               ("data", b"abcd")]), "beyond capacity_bytes"),
    (_archive([("kibotos-transfer.json", _manifest(extents=[[0, 4], [2, 4]],
                                                   data_bytes=8)),
               ("data", b"abcdabcd")]), "overlaps"),
    (_archive([("kibotos-transfer.json", _manifest(data_bytes=5)), ("data", b"abcd")]),
     "data_bytes 5"),
    (_archive([("kibotos-transfer.json", _manifest()), ("data", b"abc")]),
     "data member has 3 bytes"),
    (_archive([("kibotos-transfer.json", _manifest()), ("data", b"abcd"),
               ("more", b"")]), "unexpected member 'more'"),
])
def test_what_is_not_our_archive_is_refused(tmp_path: Path, blob: bytes, needle: str):
    with pytest.raises(InvalidArgument, match=needle):
        _unpack(blob, tmp_path)


def test_kind_mismatch_and_truncation_are_refused(tmp_path: Path):
    src = tmp_path / "src.ext4"
    sparse_file(src)
    blob, _ = pack(src)
    with pytest.raises(InvalidArgument, match="holds a volume"):
        _unpack(blob, tmp_path, expect_kind="retained_layer")
    with pytest.raises(InvalidArgument, match="not a kibotos Transfer archive"):
        _unpack(blob[: len(blob) // 2], tmp_path)
