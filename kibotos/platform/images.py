"""ext4 block images: Template images from a directory, empty writable layers, Volumes.

All are sparse files made with ``truncate`` semantics and ``mkfs.ext4`` (TESTBED: a
1 GiB empty image takes 0.01 s; ``mkfs.ext4 -d DIR`` fills one from a directory in
about a second), so nothing needs root, loop devices or mounts.  `read_file` reads a
file back with ``debugfs`` without mounting, which is how tests check what a guest
wrote.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kibotos.core.errors import FailedPrecondition, InvalidArgument

MIB = 1 << 20


def _mkfs(argv: list[str], what: str) -> None:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    except FileNotFoundError:
        raise FailedPrecondition(f"{what}: mkfs.ext4 is not installed (e2fsprogs)") from None
    if proc.returncode != 0:
        raise FailedPrecondition(f"{what}: mkfs.ext4 exited with {proc.returncode}: "
                                 f"{(proc.stderr or proc.stdout).strip()[-500:]}")


def _sparse_file(path: Path, size: int) -> None:
    if size <= 0 or size % MIB:
        raise InvalidArgument(f"image size {size} must be a positive whole number of MiB")
    try:
        with open(path, "xb") as f:
            f.truncate(size)
    except FileExistsError:
        raise FailedPrecondition(f"image {path} already exists") from None
    except OSError as exc:
        raise FailedPrecondition(f"create image {path}: {exc.strerror}") from None


def create_ext4(path: Path, size: int, *, label: str = "", journal: bool = True,
                source_dir: Path | None = None, inodes: int | None = None) -> None:
    """A new sparse ext4 image at `path` (which must not exist), filled from `source_dir`.

    Lazy inode-table and journal initialisation keep it sparse; no blocks are reserved
    for root (a guest's disk is all the guest's)."""
    if len(label.encode()) > 16:
        raise InvalidArgument(f"ext4 label {label!r} is longer than 16 bytes")
    _sparse_file(path, size)
    argv = ["mkfs.ext4", "-q", "-F", "-m", "0",
            "-E", "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0"]
    if label:
        argv += ["-L", label]
    if not journal:
        argv += ["-O", "^has_journal"]
    if inodes is not None:
        argv += ["-N", str(inodes)]
    if source_dir is not None:
        argv += ["-d", str(source_dir)]
    argv.append(str(path))
    try:
        _mkfs(argv, f"make ext4 image {path}")
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def create_writable_layer(path: Path, size: int) -> None:
    """An empty writable layer (journaled: it is written while the guest runs).  The
    guest init creates ``upper/`` and ``work/`` on it at first boot."""
    create_ext4(path, size, label="kibotos-rw")


def tree_usage(root: Path) -> tuple[int, int]:
    """(bytes in 4 KiB blocks, inode count) of a directory tree, hard links once."""
    seen: set[tuple[int, int]] = set()
    blocks = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            st = os.lstat(os.path.join(dirpath, name))
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            blocks += (st.st_size + 4095) // 4096
    return blocks * 4096, len(seen) + 1


def template_size(root: Path, *, headroom: float = 0.15, minimum: int = 64 * MIB) -> tuple[
        int, int]:
    """(image size, inode count) that hold `root` read-only with a little headroom:
    the Template is never written by a guest (writes go to the overlay's upper layer),
    so only ext4's metadata needs room."""
    used, inodes = tree_usage(root)
    size = int(used * (1 + headroom)) + inodes * 256 + 32 * MIB
    size = max(minimum, -(-size // MIB) * MIB)
    return size, inodes + inodes // 4 + 64


def read_file(image: Path, path: str) -> bytes:
    """The content of `path` inside the ext4 `image`, read with debugfs (no mount).

    Raises FileNotFoundError when the image has no such file."""
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
    stat = subprocess.run(["debugfs", "-R", f"stat {path}", str(image)],
                          capture_output=True, env=env, check=False)
    if stat.returncode != 0 or b"File not found" in stat.stderr or b"Inode:" not in stat.stdout:
        raise FileNotFoundError(f"{path} in {image}")
    proc = subprocess.run(["debugfs", "-R", f"cat {path}", str(image)],
                          capture_output=True, env=env, check=False)
    if proc.returncode != 0:
        raise FailedPrecondition(f"debugfs cat {path} {image}: {proc.stderr.decode()[-300:]}")
    return proc.stdout
