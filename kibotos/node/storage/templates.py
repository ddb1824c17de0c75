"""Where a Template's blobs are on this node: the image, the kernel, the initramfs.

``instance.create`` names a Template by its blobs' digests.  For each blob, in order:

1. the node's Template cache (``<storage.root>/template-cache/sha256/<hex>``,
   `kibotos.node.storage.template_cache.TemplateCache`) when it already holds it;
2. the local artifact directories of ``[vmm] artifact_dirs`` (same ``sha256/<hex>``
   layout: blobs put on the host by hand, by a package or by a test), used in place;
3. else the cache fetches it from ctrl's artifact store (with the node's credential).

The Instance pins its blobs in the cache while it exists (`release` unpins them when it
is destroyed), and the blobs are linked into the Instance directory (hard links where
the file system allows, else symbolic links): the cache never evicts a hard-linked
blob, and the VMM backend gets its Platform as a directory with ``vmlinux`` and
``initramfs``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import trio

from kibotos.core import ids
from kibotos.core.errors import FailedPrecondition, KibotosError
from kibotos.node.storage.template_cache import TemplateCache
from kibotos.protocol import TemplateRef


@dataclass(frozen=True)
class ResolvedTemplate:
    image: Path
    kernel: Path
    initramfs: Path


class TemplateSource(Protocol):
    async def resolve(self, template: TemplateRef, *, holder: str) -> ResolvedTemplate:
        """The local files of `template`'s blobs, kept for `holder` (an Instance ID)."""

    async def release(self, holder: str) -> None:
        """`holder` no longer needs its blobs."""

    async def aclose(self) -> None:
        """The node is stopping: close connections."""


class NodeTemplates:
    """The cache, with local artifact directories before any fetch (see the module
    docstring).  Without a cache (a node built for tests) only local blobs are found."""

    def __init__(self, cache: TemplateCache | None, local_dirs: Sequence[Path]) -> None:
        self.cache = cache
        self.local_dirs = list(local_dirs)

    def _local(self, hexdigest: str) -> Path | None:
        for base in self.local_dirs:
            path = base / "sha256" / hexdigest
            if path.is_file():
                return path
        return None

    async def _blob(self, digest: str, what: str, holder: str) -> Path:
        hexdigest = ids.digest_hex(digest)
        if self.cache is not None and \
                await trio.to_thread.run_sync(self.cache.path(digest).is_file):
            return await self.cache.ensure(digest, holder=holder)
        local = await trio.to_thread.run_sync(self._local, hexdigest)
        if local is not None:
            return local
        if self.cache is None:
            searched = ", ".join(str(d / "sha256") for d in self.local_dirs) or "nowhere"
            raise FailedPrecondition(
                f"{what} sha256:{hexdigest} is not on this node (searched {searched})",
                details={"reason": "artifact_missing", "digest": f"sha256:{hexdigest}"})
        return await self.cache.ensure(digest, holder=holder)

    async def resolve(self, template: TemplateRef, *, holder: str) -> ResolvedTemplate:
        try:
            return ResolvedTemplate(
                image=await self._blob(template.image_digest, "image", holder),
                kernel=await self._blob(template.kernel_digest, "kernel", holder),
                initramfs=await self._blob(template.initramfs_digest, "initramfs", holder))
        except KibotosError as exc:
            raise type(exc)(f"template {template.name}: {exc.message}",
                            details=exc.details) from None

    async def release(self, holder: str) -> None:
        if self.cache is not None:
            await self.cache.release(holder)

    async def aclose(self) -> None:
        if self.cache is not None:
            await self.cache.aclose()


def _link(source: Path, target: Path) -> None:
    if target.is_file() or target.is_symlink():
        target.unlink()
    try:
        os.link(source, target)
    except OSError:  # another file system (EXDEV), or links not allowed: point at it
        os.symlink(source, target)


def link_into(instance_dir: Path, resolved: ResolvedTemplate) -> tuple[Path, Path]:
    """``(platform_dir, template_image)`` inside `instance_dir`, linked to the blobs."""
    platform = instance_dir / "platform"
    platform.mkdir(exist_ok=True)
    _link(resolved.kernel, platform / "vmlinux")
    _link(resolved.initramfs, platform / "initramfs")
    image = instance_dir / "template.img"
    _link(resolved.image, image)
    return platform, image
