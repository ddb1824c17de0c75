"""kibotos.core.key_files: ctrl's key files are made once, owner-only, and never replaced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kibotos.core import key_files
from kibotos.core.errors import FailedPrecondition


def test_a_missing_secret_is_made_owner_only_and_then_read_back(tmp_path: Path) -> None:
    path = tmp_path / "state" / "key"
    made = key_files.read_or_create_private(path, "test key", lambda: b"secret")
    assert made == b"secret"
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(path.parent).st_mode & 0o777 == 0o700
    # Made once: the next read is the file, whatever `make` would give now.
    again = key_files.read_or_create_private(path, "test key", lambda: b"another")
    assert again == b"secret"


def test_a_secret_others_may_read_is_refused_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_bytes(b"secret")
    path.chmod(0o644)
    with pytest.raises(FailedPrecondition, match=r"test key .* has mode 0644.*chmod 600"):
        key_files.read_or_create_private(path, "test key", lambda: b"another")
    assert path.read_bytes() == b"secret"


def test_absent_and_unreadable_files(tmp_path: Path) -> None:
    assert key_files.read_if_present(tmp_path / "none", "test certificate") is None
    assert key_files.read_private_if_present(tmp_path / "none", "test key") is None
    with pytest.raises(FailedPrecondition, match="cannot read test certificate"):
        key_files.read_if_present(tmp_path, "test certificate")  # a directory


def test_a_file_that_is_no_pem_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "key.pem"
    with pytest.raises(FailedPrecondition, match=rf"test key {path} is not a PEM private key"):
        key_files.load_private_key(b"not a key", path, "test key")
