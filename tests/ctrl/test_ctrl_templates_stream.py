"""A large blob goes through a real ctrl (hypercorn on loopback) in both directions
without being held in memory: Python's allocation peak stays far below the blob size."""

from __future__ import annotations

import hashlib
import tracemalloc
from collections.abc import AsyncIterator

import pytest
from ctrl_helpers import RunningCtrl, error, result

from kibotos.ctrl.store.artifacts import artifact_root

SIZE = 160 << 20  # a small Template image
PIECE = 1 << 20
#: Far below SIZE: a whole-blob read would show up as at least SIZE.
PEAK_LIMIT = 40 << 20


def _piece(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (PIECE // 32)


def _digest() -> str:
    h = hashlib.sha256()
    for i in range(SIZE // PIECE):
        h.update(_piece(i))
    return h.hexdigest()


async def _body() -> AsyncIterator[bytes]:
    for i in range(SIZE // PIECE):
        yield _piece(i)


@pytest.mark.slow
async def test_large_blob_streams_both_ways(running_ctrl: RunningCtrl) -> None:
    http, operator = running_ctrl.http, running_ctrl.operator
    hexdigest = _digest()
    path = f"/v1/artifacts/sha256/{hexdigest}"

    tracemalloc.start()
    try:
        resp = await http.put(path, content=_body(), headers=operator, timeout=300)
        out = result(resp)
        _, upload_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()

        h = hashlib.sha256()
        received = 0
        async with http.stream("GET", path, headers=operator, timeout=300) as stream:
            assert stream.status_code == 200
            assert int(stream.headers["content-length"]) == SIZE
            async for chunk in stream.aiter_bytes():
                h.update(chunk)
                received += len(chunk)
        _, download_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert out == {"digest": f"sha256:{hexdigest}", "size": SIZE, "created": True}
    assert (received, h.hexdigest()) == (SIZE, hexdigest)
    blob = artifact_root(running_ctrl.config) / "sha256" / hexdigest
    assert blob.stat().st_size == SIZE
    assert upload_peak < PEAK_LIMIT, f"upload peaked at {upload_peak >> 20} MiB"
    assert download_peak < PEAK_LIMIT, f"download peaked at {download_peak >> 20} MiB"


async def test_a_cut_short_upload_leaves_nothing(running_ctrl: RunningCtrl) -> None:
    """The body ends before the digest matches (a client that gave up): refused, and no
    temporary file stays behind."""
    http, operator = running_ctrl.http, running_ctrl.operator
    hexdigest = _digest()

    async def short() -> AsyncIterator[bytes]:
        for i in range(3):
            yield _piece(i)

    resp = await http.put(f"/v1/artifacts/sha256/{hexdigest}", content=short(),
                          headers=operator, timeout=60)
    assert error(resp, "invalid_argument")["details"]["size"] == 3 * PIECE
    assert list((artifact_root(running_ctrl.config) / "sha256").iterdir()) == []
