"""The per-mount dirty page limit (spec: storage-pools-on-nfs, Notes).

Block files use buffered I/O: without a limit one VMM writing continuously can queue
gigabytes of dirty pages for the NFS mount, and after an isolate this node then takes
long to flush and write its release receipt, while the node taking over may already
open the object.  So, after the marker check, the mount's writeback device
``<sys_root>/class/bdi/<major>:<minor>/`` gets ``max_bytes`` = 256 MiB (a smaller value
already there is kept) and ``strict_limit`` = 1.  Kernels before 6.2 have neither file;
a read-only sysfs refuses the write: both make the pool unavailable, with the device
number in the reason.
"""

from __future__ import annotations

from pathlib import Path

#: Sized for a gigabit link: about 550 MB flush in one 5-second self-check interval.
MAX_BYTES = 256 * 2**20


class WritebackError(Exception):
    """The limit could not be set; the message is the availability reason."""


def limit_dirty_pages(sys_root: Path, device: str, where: str) -> None:
    bdi = sys_root / "class" / "bdi" / device
    max_file, strict_file = bdi / "max_bytes", bdi / "strict_limit"
    prefix = (f"{where}: cannot limit the dirty page cache of its writeback device "
              f"{device}")
    if not max_file.is_file() or not strict_file.is_file():
        raise WritebackError(
            f"{prefix}: {bdi} has no max_bytes or strict_limit (they need Linux 6.2 or "
            "later)")
    try:
        current = int(max_file.read_text().strip())
    except (OSError, ValueError) as exc:
        raise WritebackError(f"{prefix}: read {max_file}: {exc}") from None
    try:
        if current > MAX_BYTES:
            max_file.write_text(f"{MAX_BYTES}\n")
        if strict_file.read_text().strip() != "1":
            strict_file.write_text("1\n")
    except OSError as exc:
        raise WritebackError(
            f"{prefix}: write {exc.filename or bdi}: {exc.strerror or exc} (the node must "
            "be able to write to /sys/class/bdi/)") from None
