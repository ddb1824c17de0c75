"""Where a Template's blobs are on this node: the image, the kernel, the initramfs.

``instance.create`` names a Template by its blobs' digests.  The node's template cache
(``<storage.root>/template-cache/sha256/<hex>``, filled from ctrl's artifact store by
digest; docs/architecture.md "Templates and the artifact store") is searched first,
then the local artifact directories of ``[vmm] artifact_dirs`` (same ``sha256/<hex>``
layout: a directory prepared by hand or by a test).  Fetching a missing blob from ctrl
is the cache's job (`TemplateSource` is the seam it plugs into); this resolver only
finds blobs already on the host.

The blobs are linked into the Instance directory (hard links where the file system
allows, else symbolic links), so the cache may evict a blob while a VM uses it, and the
VMM backend gets its Platform as a directory with ``vmlinux`` and ``initramfs``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import trio

from kibotos.errors import FailedPrecondition
from kibotos.node.instance_spec import TemplateRef, digest_hex


@dataclass(frozen=True)
class ResolvedTemplate:
    image: Path
    kernel: Path
    initramfs: Path


class TemplateSource(Protocol):
    async def resolve(self, template: TemplateRef) -> ResolvedTemplate:
        """The local files of `template`'s blobs; FailedPrecondition when one is missing."""


class LocalArtifacts:
    """Blobs found by digest under ``<dir>/sha256/<hex>`` of each directory, in order."""

    def __init__(self, dirs: Sequence[Path]) -> None:
        self.dirs = list(dirs)

    def find(self, digest: str, what: str, template: str) -> Path:
        hexdigest = digest_hex(digest)
        for base in self.dirs:
            path = base / "sha256" / hexdigest
            if path.is_file():
                return path
        searched = ", ".join(str(d / "sha256") for d in self.dirs) or "no directories"
        raise FailedPrecondition(
            f"template {template}: {what} sha256:{hexdigest} is not on this node "
            f"(searched {searched})", details={"reason": "artifact_missing",
                                               "digest": f"sha256:{hexdigest}"})

    def _resolve(self, template: TemplateRef) -> ResolvedTemplate:
        return ResolvedTemplate(
            image=self.find(template.image_digest, "image", template.name),
            kernel=self.find(template.kernel_digest, "kernel", template.name),
            initramfs=self.find(template.initramfs_digest, "initramfs", template.name))

    async def resolve(self, template: TemplateRef) -> ResolvedTemplate:
        return await trio.to_thread.run_sync(self._resolve, template)


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
