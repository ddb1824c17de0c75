"""`SecretBox`: ctrl's key for secrets at rest, made once with mode 0600 and never
replaced; a sealed value opens only with that key and for what it was sealed for."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kibotos.core.errors import FailedPrecondition, Internal
from kibotos.ctrl.store.secret_box import KEY_SIZE, SecretBox


def test_the_key_is_made_once_private(tmp_path: Path) -> None:
    path = tmp_path / "state" / "egress-secrets.key"
    box = SecretBox.load_or_create(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert len(path.read_bytes()) == KEY_SIZE
    sealed = box.seal("s3cret", "egress corp revision 1")
    assert "s3cret" not in sealed
    again = SecretBox.load_or_create(path)
    assert again.open(sealed, "egress corp revision 1") == "s3cret"
    assert again.mac("s3cret", "x") == box.mac("s3cret", "x") != box.mac("other", "x")


def test_a_sealed_value_is_bound_to_its_context_and_key(tmp_path: Path) -> None:
    box = SecretBox.load_or_create(tmp_path / "a.key")
    sealed = box.seal("s3cret", "egress corp revision 1")
    with pytest.raises(Internal) as info:
        box.open(sealed, "egress corp revision 2")
    assert "s3cret" not in info.value.message
    with pytest.raises(Internal):
        SecretBox.load_or_create(tmp_path / "b.key").open(sealed, "egress corp revision 1")
    with pytest.raises(Internal):
        box.open("v1.not-base64!", "egress corp revision 1")
    # Two seals of one secret differ (a fresh nonce each time).
    assert box.seal("s3cret", "c") != box.seal("s3cret", "c")


def test_a_bad_key_file_is_refused_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "egress-secrets.key"
    path.write_bytes(b"short")
    path.chmod(0o600)
    with pytest.raises(FailedPrecondition, match="has 5 bytes"):
        SecretBox.load_or_create(path)
    assert path.read_bytes() == b"short"
    path.write_bytes(b"k" * KEY_SIZE)
    path.chmod(0o644)
    with pytest.raises(FailedPrecondition, match="chmod 600"):
        SecretBox.load_or_create(path)
