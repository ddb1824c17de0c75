"""`atomicfile.SparseFile`: zero pieces become holes, nothing is visible before commit,
and discard leaves nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

from kibotos.core import atomicfile


def test_commit_renames_a_sparse_file_of_the_full_length(tmp_path: Path) -> None:
    target = tmp_path / "blob"
    f = atomicfile.SparseFile(target)
    data = b"head" + bytes(4 * atomicfile.HOLE_PIECE) + b"tail" + bytes(atomicfile.HOLE_PIECE)
    f.write(data)
    assert not target.exists()
    f.commit()
    f.discard()  # after commit: a no-op
    assert target.read_bytes() == data
    assert os.stat(target).st_blocks * 512 < len(data)
    assert [p.name for p in tmp_path.iterdir()] == ["blob"]


def test_discard_removes_the_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "blob"
    f = atomicfile.SparseFile(target, prefix="node-a")
    assert f.tmp is not None
    assert f.tmp.name.startswith(".node-a.")
    f.write(b"partial")
    f.discard()
    f.discard()
    assert list(tmp_path.iterdir()) == []
