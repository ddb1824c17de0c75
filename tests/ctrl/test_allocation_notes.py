"""The Allocation notices replicas send each other (`kibotos.ctrl.store.allocation_notes`):
what is encoded decodes to the same snapshots, payloads stay under PostgreSQL's limit,
and a line that is not one of ours is skipped, not applied."""

from __future__ import annotations

import logging

import pytest

from kibotos.ctrl.store import allocation_notes as notes
from kibotos.ctrl.store.changes import AllocationSnapshot


def _snap(i: int, released: bool = False) -> AllocationSnapshot:
    return AllocationSnapshot(f"inst-{i:026d}", f"node-{i % 7:04d}", 250 * i, 1 << 30,
                              released)


def test_what_is_encoded_decodes_to_the_same_snapshots() -> None:
    snaps = [_snap(1), _snap(2, released=True)]
    (payload,) = notes.encode("rep-1", snaps)
    assert notes.decode(payload) == [("rep-1", s) for s in snaps]


def test_many_allocations_are_split_under_the_payload_limit() -> None:
    snaps = [_snap(i) for i in range(500)]
    payloads = list(notes.encode("rep-01m915pwg9y45mra6yrvg342j6", snaps))
    assert len(payloads) > 1
    assert all(len(p.encode()) < notes.MAX_PAYLOAD for p in payloads)
    decoded = [s for p in payloads for _, s in notes.decode(p)]
    assert decoded == snaps


def test_nothing_to_announce_sends_nothing() -> None:
    assert list(notes.encode("rep-1", [])) == []


@pytest.mark.parametrize("line", [
    "rep-1 inst-1 node-1 250 1024",            # a field short
    "rep-1 inst-1 node-1 250 1024 0 extra",    # one too many
    "rep-1 inst-1 node-1 -250 1024 0",         # a sign
    "rep-1 inst-1 node-1 \u0662\u0665\u0660 1024 0",  # Arabic-Indic digits
    "rep-1 inst-1 node-1 250 1024 01",         # not a flag
    "rep-1  node-1 250 1024 0 0",              # an empty field
])
def test_a_line_not_understood_is_skipped_and_logged(
        line: str, caplog: pytest.LogCaptureFixture) -> None:
    good = "rep-2 inst-2 node-2 500 2048 1"
    with caplog.at_level(logging.WARNING):
        decoded = notes.decode(f"{line}\n{good}")
    assert decoded == [("rep-2", AllocationSnapshot("inst-2", "node-2", 500, 2048, True))]
    assert "not understood" in caplog.text
