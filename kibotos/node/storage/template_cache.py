"""The node's Template cache: blobs from ctrl's artifact store, kept by digest on disk.

Layout: ``<storage.root>/template-cache/sha256/<hex>`` (the same layout as ctrl's store
and as ``[vmm] artifact_dirs``), so a blob's name is its sha256 and a present file is a
verified file.  How the Instance manager uses it (docs/templates.md, "On the nodes")::

    cache = TemplateCache(paths.root / "template-cache", ctrl_url=…,
                          credential=lambda: identity.credential,
                          limit=config.storage.template_cache_limit)
    files = await cache.resolve(spec.template, holder=instance_id)   # fetch + pin
    … link files.image / .kernel / .initramfs into the Instance directory, boot …
    await cache.release(instance_id)             # the Instance is destroyed

* `ensure(digest)` returns the blob's path, fetching it on a miss: streamed from
  ``GET /v1/artifacts/sha256/<hex>`` with the node's bearer credential into a temporary
  file beside the target, hashed on the way (zero runs left as holes, so images stay
  sparse), and renamed into place only when the digest matches (fsync before, directory
  fsync after).  Concurrent calls for one digest share
  one download.
* Least recently used blobs are deleted when the cache would grow past `limit`
  (``storage.template_cache_limit``); "used" is the file's mtime, touched on every hit,
  so the order survives restarts.  Never deleted: a blob pinned by a holder (`pin`,
  `resolve(…, holder=)`), one being downloaded, and one with more than one hard link (an
  Instance directory links it, which also covers Instances the node adopted after a
  restart and has not pinned again yet).  When pinned blobs leave no room the cache
  goes over the limit, says so in the log, and shrinks once they are released; a blob
  larger than the whole limit is refused (`resource_exhausted`).
"""

from __future__ import annotations

import hashlib
import os
import ssl
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
import trio

from kibotos.core import atomicfile, ids
from kibotos.core.errors import (
    FailedPrecondition,
    KibotosError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kibotos.core.logs import EventLogger
from kibotos.core.units import format_bytes
from kibotos.node.session.ctrl_http import CtrlUrls, refusal
from kibotos.pieces import write_in_pieces
from kibotos.tls.contexts import client_context

log = EventLogger()

PIECE = 1 << 20
FETCH_ATTEMPTS = 3
RETRY_PAUSE = 1.0


class TemplateDigests(Protocol):
    """What `resolve` needs of a Template reference (e.g. the node's `TemplateRef`)."""

    @property
    def name(self) -> str: ...
    @property
    def image_digest(self) -> str: ...
    @property
    def kernel_digest(self) -> str: ...
    @property
    def initramfs_digest(self) -> str: ...


@dataclass(frozen=True)
class TemplateFiles:
    """The cached files of one Template's blobs."""

    image: Path
    kernel: Path
    initramfs: Path


@dataclass
class _Flight:
    """One download in progress; followers wait for `done`."""

    done: trio.Event = field(default_factory=trio.Event)
    error: KibotosError | None = None


class TemplateCache:
    def __init__(self, root: Path, *, ctrl_url: str | Sequence[str],
                 credential: str | Callable[[], str | None] | None, limit: int,
                 http: httpx.AsyncClient | None = None, timeout: float = 300.0,
                 verify: ssl.SSLContext | None = None) -> None:
        self.root = root
        #: Checks ctrl's certificate (``[node] ctrl_ca_file``; default the system store).
        self.verify = verify or client_context()
        self.blobs = root / "sha256"
        #: ctrl's replicas (``[node] ctrl_url``): a fetch that cannot reach one retries
        #: on the next.
        self.urls = CtrlUrls(ctrl_url)
        self._credential = credential
        self.limit = limit
        self._http = http
        self._own_http = http is None
        self._timeout = timeout
        self._flights: dict[str, _Flight] = {}
        self._holders: dict[str, set[str]] = {}  # holder -> hex digests it pins
        self._evict_lock = trio.Lock()

    async def aclose(self) -> None:
        if self._own_http and self._http is not None:
            await self._http.aclose()
            self._http = None

    # ------------------------------------------------------------------ pins

    def pin(self, holder: str, digests: Iterable[str]) -> None:
        """Keep these blobs while `holder` (an Instance ID) uses them; pins add up."""
        self._holders.setdefault(holder, set()).update(ids.digest_hex(d) for d in digests)

    async def release(self, holder: str) -> None:
        """Drop every pin of `holder` and shrink the cache back under its limit."""
        if self._holders.pop(holder, None) is not None:
            await self.evict()

    def pinned(self) -> set[str]:
        """Hex digests pinned by any holder."""
        return set().union(*self._holders.values()) if self._holders else set()

    # ------------------------------------------------------------------ lookups

    def path(self, digest: str) -> Path:
        return self.blobs / ids.digest_hex(digest)

    async def resolve(self, template: TemplateDigests, *, holder: str | None = None
                      ) -> TemplateFiles:
        """The three blobs of `template`, fetched as needed and, with `holder`, pinned
        before any of them is fetched (so none is evicted while the others arrive)."""
        digests = (template.image_digest, template.kernel_digest, template.initramfs_digest)
        if holder is not None:
            self.pin(holder, digests)
        try:
            image, kernel, initramfs = [await self.ensure(d) for d in digests]
        except KibotosError as exc:
            raise type(exc)(f"template {template.name}: {exc.message}",
                            details=exc.details) from exc
        return TemplateFiles(image=image, kernel=kernel, initramfs=initramfs)

    async def ensure(self, digest: str, *, holder: str | None = None) -> Path:
        """The path of blob `digest` in the cache, fetched from ctrl if missing."""
        hexdigest = ids.digest_hex(digest)
        if holder is not None:
            self.pin(holder, [hexdigest])
        target = self.blobs / hexdigest
        while True:
            if await trio.to_thread.run_sync(_touch, target):
                return target
            flight = self._flights.get(hexdigest)
            if flight is not None:
                await flight.done.wait()
                if flight.error is not None:
                    raise flight.error
                continue  # the leader finished (or was cancelled): look again
            flight = self._flights[hexdigest] = _Flight()
            try:
                await self._fetch(hexdigest, target)
                await self._make_room(0, None, also_keep=hexdigest)
            except KibotosError as exc:
                flight.error = exc
                raise
            finally:
                del self._flights[hexdigest]
                flight.done.set()
            return target

    # ------------------------------------------------------------------ fetching

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(self._timeout, connect=30),
                                           verify=self.verify)
        return self._http

    def _headers(self) -> dict[str, str]:
        cred = self._credential() if callable(self._credential) else self._credential
        return {"Authorization": f"Bearer {cred}"} if cred else {}

    @property
    def ctrl_url(self) -> str:
        return self.urls.current

    async def _fetch(self, hexdigest: str, target: Path) -> None:
        for attempt in range(1, FETCH_ATTEMPTS + 1):
            base = self.urls.current
            try:
                await self._download(f"{base}/v1/artifacts/sha256/{hexdigest}", hexdigest,
                                     target)
                return
            except httpx.TransportError as exc:
                self.urls.failed(base)
                if attempt == FETCH_ATTEMPTS:
                    raise Unavailable(f"fetch artifact sha256:{hexdigest}: cannot reach "
                                      f"ctrl at {base}: {exc or type(exc).__name__}"
                                      ) from None
            except _Corrupt as exc:
                if attempt == FETCH_ATTEMPTS:
                    raise FailedPrecondition(str(exc)) from None
            except OSError as exc:
                raise FailedPrecondition(
                    f"fetch artifact sha256:{hexdigest}: write into {self.blobs}: "
                    f"{exc.strerror or exc}") from None
            log.warning("template cache: fetch failed, retrying", digest=hexdigest,
                        attempt=attempt)
            await trio.sleep(RETRY_PAUSE * attempt)

    async def _download(self, url: str, hexdigest: str, target: Path) -> None:
        started = time.monotonic()
        async with self._client().stream("GET", url, headers=self._headers()) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise _refusal(resp, hexdigest)
            length = resp.headers.get("content-length")
            if length is not None and length.isdigit():
                await self._make_room(int(length), hexdigest, also_keep=hexdigest)
            sink = await trio.to_thread.run_sync(_Sink, target)
            try:
                await write_in_pieces(resp.aiter_raw(), sink.write, PIECE)
                got = sink.hash.hexdigest()
                if got != hexdigest:
                    raise _Corrupt(f"fetch artifact sha256:{hexdigest}: the {sink.size} "
                                   f"bytes ctrl sent hash to sha256:{got}")
                await trio.to_thread.run_sync(sink.commit)
            finally:
                sink.discard()
        log.info("template cache: fetched", digest=hexdigest, size=sink.size,
                 seconds=round(time.monotonic() - started, 2))

    # ------------------------------------------------------------------ eviction

    def usage(self) -> int:
        """Bytes the cache's blobs take (apparent size)."""
        return sum(size for _, size, _, _ in _listing(self.blobs))

    async def evict(self) -> list[str]:
        """Delete least recently used blobs until the cache fits its limit; returns the
        hex digests deleted."""
        return await self._make_room(0, None)

    async def _make_room(self, need: int, incoming: str | None, *,
                         also_keep: str | None = None) -> list[str]:
        """Evict until `need` more bytes fit; `incoming` names the blob they are for
        (refused when it could never fit), `also_keep` a blob this call must not take
        (the one just fetched, not pinned by anyone yet)."""
        if incoming is not None and need > self.limit:
            raise ResourceExhausted(
                f"artifact sha256:{incoming} ({format_bytes(need)}) is larger than the "
                f"node's storage.template_cache_limit ({format_bytes(self.limit)})",
                details={"digest": f"sha256:{incoming}", "size": need,
                         "template_cache_limit": self.limit})
        async with self._evict_lock:
            keep = self.pinned() | set(self._flights) | ({also_keep} if also_keep else set())
            removed, total = await trio.to_thread.run_sync(
                _evict, self.blobs, self.limit - need, keep)
        for hexdigest in removed:
            log.info("template cache: evicted", digest=hexdigest)
        if total + need > self.limit:
            log.warning("template cache: over its limit, blobs in use",
                        used=total + need, limit=self.limit)
        return removed


class _Corrupt(Exception):
    """The body did not hash to the digest (a proxy or disk problem): retried."""


def _refusal(resp: httpx.Response, hexdigest: str) -> KibotosError:
    err = refusal(resp, f"fetch artifact sha256:{hexdigest}")
    if isinstance(err, NotFound):
        return FailedPrecondition(
            f"artifact sha256:{hexdigest} is not in ctrl's artifact store (upload it with "
            "`kibo template import` or `kibo template build`)",
            details={"reason": "artifact_missing", "digest": f"sha256:{hexdigest}"})
    return err


def _touch(path: Path) -> bool:
    """Mark a cached blob as just used; False when it is not there."""
    try:
        os.utime(path)
    except FileNotFoundError:
        return False
    return True


def _listing(blobs: Path) -> list[tuple[str, int, float, int]]:
    """(hex, size, mtime, link count) of every complete blob."""
    out = []
    try:
        entries = list(os.scandir(blobs))
    except FileNotFoundError:
        return []
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        out.append((entry.name, st.st_size, st.st_mtime, st.st_nlink))
    return out


def _evict(blobs: Path, budget: int, keep: set[str]) -> tuple[list[str], int]:
    """Delete the oldest blobs not in `keep` and not linked elsewhere until the total is
    at most `budget`; returns (deleted, total after)."""
    listing = _listing(blobs)
    total = sum(size for _, size, _, _ in listing)
    removed = []
    for hexdigest, size, _mtime, nlink in sorted(listing, key=lambda e: e[2]):
        if total <= budget:
            break
        if hexdigest in keep or nlink > 1:
            continue
        (blobs / hexdigest).unlink(missing_ok=True)
        total -= size
        removed.append(hexdigest)
    if removed:
        atomicfile.fsync_dir(blobs)
    return removed, total


class _Sink(atomicfile.SparseFile):
    """The temporary file one download writes, hashed as it goes; renamed into place
    by `commit`."""

    def __init__(self, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        super().__init__(target)
        self.hash = hashlib.sha256()

    def write(self, data: bytes) -> None:
        self.hash.update(data)
        super().write(data)
