"""The node's Template cache against a real ctrl (hypercorn on loopback, SQLite): fetch
with the node's credential, verification, coalesced downloads, LRU eviction past the
limit, and the blobs eviction must never take (pinned, linked, being fetched)."""

from __future__ import annotations

import hashlib
import os
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio
from artifact_ctrl_harness import loopback_ctrl

from kibotos.core.errors import FailedPrecondition, ResourceExhausted, Unauthenticated, Unavailable
from kibotos.node.storage import template_cache
from kibotos.node.storage.template_cache import TemplateCache

BLOB = 64 << 10


@dataclass
class Ctrl:
    url: str
    operator: dict[str, str]
    node_credential: str
    artifacts: Path
    http: httpx.AsyncClient
    tls: ssl.SSLContext  # verifies ctrl's certificate

    async def upload(self, data: bytes) -> str:
        hexdigest = hashlib.sha256(data).hexdigest()
        resp = await self.http.put(f"/v1/artifacts/sha256/{hexdigest}", content=data,
                                   headers=self.operator)
        assert resp.status_code == 200, resp.text
        return f"sha256:{hexdigest}"


@pytest.fixture
async def ctrl(tmp_path: Path) -> AsyncIterator[Ctrl]:
    async with loopback_ctrl(tmp_path, ("node-a",)) as c:
        yield Ctrl(c.url, c.operator, c.credentials["node-a"], c.artifacts, c.http, c.tls)


class Counting:
    """An httpx client for the cache that counts the blob requests it makes."""

    def __init__(self, verify: ssl.SSLContext) -> None:
        self.gets: list[str] = []

        async def hook(request: httpx.Request) -> None:
            self.gets.append(request.url.path.rsplit("/", 1)[1])

        self.client = httpx.AsyncClient(timeout=60, event_hooks={"request": [hook]},
                                        verify=verify)


@pytest.fixture
async def counting(ctrl: Ctrl) -> AsyncIterator[Counting]:
    c = Counting(ctrl.tls)
    try:
        yield c
    finally:
        await c.client.aclose()


def make_cache(tmp_path: Path, ctrl: Ctrl, counting: Counting, limit: int = 100 << 20,
               credential: str | None = None) -> TemplateCache:
    return TemplateCache(tmp_path / "root" / "template-cache", ctrl_url=ctrl.url,
                         credential=lambda: credential or ctrl.node_credential,
                         limit=limit, http=counting.client, verify=ctrl.tls)


def cache_files(cache: TemplateCache) -> list[str]:
    return sorted(p.name for p in cache.blobs.iterdir()) if cache.blobs.exists() else []


def age(cache: TemplateCache, digest: str, seconds_ago: float) -> None:
    """Set a blob's last use (file time resolution is too coarse to rely on order)."""
    t = os.path.getmtime(cache.path(digest)) - seconds_ago
    os.utime(cache.path(digest), (t, t))


async def test_fetch_verify_and_hit(tmp_path: Path, ctrl: Ctrl, counting: Counting) -> None:
    data = os.urandom(3 * BLOB + 17)
    digest = await ctrl.upload(data)
    cache = make_cache(tmp_path, ctrl, counting)
    path = await cache.ensure(digest)
    assert path == cache.blobs / digest.removeprefix("sha256:")
    assert path.read_bytes() == data
    assert await cache.ensure(digest.removeprefix("sha256:")) == path  # bare hex too
    assert len(counting.gets) == 1  # the second was a hit
    assert cache_files(cache) == [path.name]  # no temporary files
    assert cache.usage() == len(data)


async def test_concurrent_requests_share_one_download(tmp_path: Path, ctrl: Ctrl,
                                                      counting: Counting) -> None:
    digest = await ctrl.upload(os.urandom(8 << 20))
    cache = make_cache(tmp_path, ctrl, counting)
    paths: list[Path] = []
    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(lambda: _append(paths, cache.ensure(digest)))
    assert len(paths) == 6
    assert len(set(paths)) == 1
    assert counting.gets == [digest.removeprefix("sha256:")]


async def _append(out: list[Path], coro: object) -> None:
    out.append(await coro)  # type: ignore[misc]


async def test_a_corrupt_blob_is_refused_and_nothing_stays(
        tmp_path: Path, ctrl: Ctrl, counting: Counting, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(template_cache, "RETRY_PAUSE", 0.0)
    data = os.urandom(BLOB)
    digest = await ctrl.upload(data)
    # Damage ctrl's copy behind its back (a bad disk, a bad proxy): same size, other bytes.
    (ctrl.artifacts / digest.removeprefix("sha256:")).write_bytes(os.urandom(BLOB))
    cache = make_cache(tmp_path, ctrl, counting)
    with pytest.raises(FailedPrecondition, match="hash to"):
        await cache.ensure(digest)
    assert len(counting.gets) == template_cache.FETCH_ATTEMPTS
    assert cache_files(cache) == []


async def test_refusals_name_what_is_wrong(tmp_path: Path, ctrl: Ctrl, counting: Counting,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(template_cache, "RETRY_PAUSE", 0.0)
    cache = make_cache(tmp_path, ctrl, counting)
    with pytest.raises(FailedPrecondition, match="not in ctrl's artifact store") as missing:
        await cache.ensure("sha256:" + "0" * 64)
    assert missing.value.details["reason"] == "artifact_missing"
    digest = await ctrl.upload(b"x" * 100)
    bad = make_cache(tmp_path / "bad", ctrl, counting, credential="kid-nope:wrong")
    with pytest.raises(Unauthenticated):
        await bad.ensure(digest)
    gone = TemplateCache(tmp_path / "gone", ctrl_url="http://127.0.0.1:9", credential="x",
                         limit=1 << 20, http=counting.client)
    with pytest.raises(Unavailable, match="cannot reach ctrl"):
        await gone.ensure(digest)
    assert cache_files(cache) == cache_files(bad) == cache_files(gone) == []


async def test_lru_eviction_past_the_limit(tmp_path: Path, ctrl: Ctrl,
                                           counting: Counting) -> None:
    digests = [await ctrl.upload(os.urandom(BLOB) + bytes([i])) for i in range(5)]
    size = BLOB + 1
    cache = make_cache(tmp_path, ctrl, counting, limit=3 * size)
    a, b, c, d, e = digests
    for i, digest in enumerate((a, b, c)):
        await cache.ensure(digest)
        age(cache, digest, 100 - i)  # a oldest, then b, then c
    await cache.ensure(a)  # a hit: a is now the most recently used
    await cache.ensure(d)  # room for d: b, the least recently used, goes
    assert cache_files(cache) == sorted(x.removeprefix("sha256:") for x in (a, c, d))
    assert cache.usage() <= cache.limit
    age(cache, d, 50)
    await cache.ensure(e)  # c is now the oldest unused
    assert cache_files(cache) == sorted(x.removeprefix("sha256:") for x in (a, d, e))


async def test_pinned_and_linked_blobs_are_never_evicted(tmp_path: Path, ctrl: Ctrl,
                                                         counting: Counting) -> None:
    digests = [await ctrl.upload(os.urandom(BLOB) + bytes([i])) for i in range(4)]
    size = BLOB + 1
    cache = make_cache(tmp_path, ctrl, counting, limit=2 * size)
    a, b, c, d = digests
    await cache.ensure(a, holder="inst-1")
    age(cache, a, 100)
    await cache.ensure(b)
    age(cache, b, 90)
    # b is linked into an Instance directory (as the node's launcher does): in use.
    instance_dir = tmp_path / "root" / "runtime" / "inst-2"
    instance_dir.mkdir(parents=True)
    os.link(cache.path(b), instance_dir / "template.img")

    # Both older blobs are in use: c goes over the limit rather than evict them.
    await cache.ensure(c)
    assert set(cache_files(cache)) == {x.removeprefix("sha256:") for x in (a, b, c)}
    assert cache.usage() == 3 * size
    age(cache, c, 80)

    # Releasing the pin shrinks the cache back: a (oldest, now unpinned) goes.
    await cache.release("inst-1")
    assert set(cache_files(cache)) == {x.removeprefix("sha256:") for x in (b, c)}
    (instance_dir / "template.img").unlink()
    await cache.ensure(d)
    assert set(cache_files(cache)) == {x.removeprefix("sha256:") for x in (c, d)}


async def test_resolve_pins_a_templates_three_blobs(tmp_path: Path, ctrl: Ctrl,
                                                    counting: Counting) -> None:
    @dataclass(frozen=True)
    class Ref:
        name: str
        image_digest: str
        kernel_digest: str
        initramfs_digest: str

    blobs = [os.urandom(BLOB) + bytes([i]) for i in range(3)]
    ref = Ref("kibotos-base", *[await ctrl.upload(b) for b in blobs])
    cache = make_cache(tmp_path, ctrl, counting, limit=3 * (BLOB + 1))
    files = await cache.resolve(ref, holder="inst-1")
    assert [files.image.read_bytes(), files.kernel.read_bytes(),
            files.initramfs.read_bytes()] == blobs
    assert cache.pinned() == {d.removeprefix("sha256:") for d in
                              (ref.image_digest, ref.kernel_digest, ref.initramfs_digest)}
    other = await ctrl.upload(os.urandom(BLOB) + b"other")
    await cache.ensure(other)  # over the limit, but nothing of inst-1 may go
    assert all(p.exists() for p in (files.image, files.kernel, files.initramfs))
    await cache.release("inst-1")
    assert cache.pinned() == set()
    assert cache.usage() <= cache.limit
    with pytest.raises(FailedPrecondition, match="template kibotos-base: artifact"):
        await cache.resolve(Ref("kibotos-base", ref.image_digest, "0" * 64,
                                ref.initramfs_digest))


async def test_a_blob_larger_than_the_limit_is_refused(tmp_path: Path, ctrl: Ctrl,
                                                       counting: Counting) -> None:
    digest = await ctrl.upload(os.urandom(2 * BLOB))
    cache = make_cache(tmp_path, ctrl, counting, limit=BLOB)
    with pytest.raises(ResourceExhausted, match="template_cache_limit"):
        await cache.ensure(digest)
    assert cache_files(cache) == []


async def test_fetched_images_stay_sparse(tmp_path: Path, ctrl: Ctrl,
                                          counting: Counting) -> None:
    data = os.urandom(1000) + bytes(5 << 20) + os.urandom(1000) + bytes(2 << 20)
    digest = await ctrl.upload(data)
    cache = make_cache(tmp_path, ctrl, counting)
    path = await cache.ensure(digest)
    assert path.read_bytes() == data
    assert path.stat().st_blocks * 512 < 1 << 20
