"""Incarnations: strictly increasing, persisted before use, never silently reset."""

from __future__ import annotations

from pathlib import Path

import pytest

from kibotos.core import failpoints
from kibotos.core.errors import FailedPrecondition
from kibotos.node.host.incarnation import next_incarnation, read_incarnation


def test_first_start_is_one_and_each_start_adds_one(tmp_path: Path) -> None:
    path = tmp_path / "incarnation"
    assert read_incarnation(path) is None
    assert [next_incarnation(path) for _ in range(3)] == [1, 2, 3]
    assert path.read_text() == "3\n"
    assert read_incarnation(path) == 3


def test_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "incarnation"
    next_incarnation(path)
    assert path.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("content", ["", "\n", "abc\n", "0\n", "-3\n", "4", "4\n5\n", "4.0\n",
                                     " 4\n"])
def test_corrupt_file_is_an_error_and_stays_untouched(tmp_path: Path, content: str) -> None:
    path = tmp_path / "incarnation"
    path.write_text(content)
    with pytest.raises(FailedPrecondition, match="corrupt") as info:
        next_incarnation(path)
    assert str(path) in info.value.message
    assert path.read_text() == content


def test_unreadable_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "incarnation"
    path.mkdir()  # reading a directory fails even for root
    with pytest.raises(FailedPrecondition, match="cannot read incarnation file"):
        next_incarnation(path)


def test_incarnation_is_on_disk_when_the_failpoint_fires(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "incarnation"
    path.write_text("7\n")
    monkeypatch.setenv(failpoints.ENV, "node.incarnation.after-write=error")
    failpoints.reload()
    try:
        with pytest.raises(failpoints.FailpointError):
            next_incarnation(path)
    finally:
        monkeypatch.delenv(failpoints.ENV)
        failpoints.reload()
    # The crash came after the write: the next start must not reuse 8.
    assert path.read_text() == "8\n"
    assert next_incarnation(path) == 9
