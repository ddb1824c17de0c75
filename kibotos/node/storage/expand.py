"""Growing an ext4 block file in place: e2fsck, (tune2fs), resize2fs on the file.

The spec (storage-pools-on-nfs, "Notes"): the node runs ``e2fsck`` and ``resize2fs`` on
the whole block file on the host, never through a loop mount; when the target exceeds
what the file system's reserved group-descriptor blocks allow, it first removes
``resize_inode`` with ``tune2fs`` and checks again.  Each tool has 10 minutes, the whole
expansion 45.

Every step is derived from the block file's current state, so a run that failed or was
killed anywhere is finished by a new run with the same (or a larger) target:

1. ``e2fsck -f -y``: always, first.  It repairs what an interrupted step left (and
   ``resize2fs`` refuses a file system not checked since its last change).
2. ``dumpe2fs -h``: the geometry.  If the target needs more descriptor blocks than the
   current ones plus the reserved ones and ``resize_inode`` is still there:
   ``tune2fs -O ^resize_inode``, then ``e2fsck -f -y`` again (``tune2fs`` asks for it:
   the reserved blocks are given back only by the check).
3. The file grows to the target length (``truncate``; never shorter), fsynced.
4. ``resize2fs FILE <target>K`` unless the file system already has the target's blocks.

`expand_file` reports each step through `progress` before it starts (the caller
records it in the object's metadata) and hits a failpoint after it, so tests can stop
the node between any two steps.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from kibotos.core import failpoints
from kibotos.core.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument

#: Spec: each tool at most 10 minutes, the whole expansion at most 45.
TOOL_TIMEOUT = 600.0
TOTAL_TIMEOUT = 2700.0
#: Where the tools are looked up (tests put stand-ins in front with `tool_path`).
TOOL_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
_OUTPUT_TAIL = 1500

#: Steps in the order they run (the ``step`` of the metadata's ``expansion``).
CHECK, REMOVE_RESIZE_INODE, RECHECK, GROW_FILE, RESIZE = (
    "check", "remove_resize_inode", "recheck", "grow_file", "resize")

Progress = Callable[[str], Awaitable[None]]


class ExpansionFailed(FailedPrecondition):
    """A tool failed; ``details`` name the step, the tool, its exit code and output."""


@dataclass(frozen=True)
class Geometry:
    """What ``dumpe2fs -h`` says about the file system's size and layout."""

    block_size: int
    block_count: int
    first_block: int
    blocks_per_group: int
    desc_size: int
    reserved_gdt_blocks: int
    features: frozenset[str]

    def groups(self, blocks: int) -> int:
        return -(-(blocks - self.first_block) // self.blocks_per_group)

    def max_blocks_in_place(self) -> int | None:
        """The largest size (in blocks) reachable with the descriptor blocks the file
        system has plus the reserved ones; None when there is no such limit (``meta_bg``,
        or no ``resize_inode``: then resize2fs makes room itself)."""
        if "meta_bg" in self.features or "resize_inode" not in self.features:
            return None
        per_block = self.block_size // self.desc_size
        gdt_now = -(-self.groups(self.block_count) // per_block)
        max_groups = (gdt_now + self.reserved_gdt_blocks) * per_block
        return max_groups * self.blocks_per_group + self.first_block

    def needs_resize_inode_removal(self, target_blocks: int) -> bool:
        limit = self.max_blocks_in_place()
        return limit is not None and target_blocks > limit


def parse_geometry(text: str) -> Geometry:
    """`Geometry` from the output of ``dumpe2fs -h``."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()

    def number(key: str, default: int | None = None) -> int:
        raw = fields.get(key)
        if raw is None:
            if default is None:
                raise FailedPrecondition(f"dumpe2fs did not report {key!r}")
            return default
        try:
            return int(raw)
        except ValueError:
            raise FailedPrecondition(f"dumpe2fs reported {key!r} as {raw!r}") from None

    return Geometry(block_size=number("Block size"), block_count=number("Block count"),
                    first_block=number("First block", 0),
                    blocks_per_group=number("Blocks per group"),
                    desc_size=number("Group descriptor size", 32),
                    reserved_gdt_blocks=number("Reserved GDT blocks", 0),
                    features=frozenset(fields.get("Filesystem features", "").split()))


async def run_tool(argv: Sequence[str], step: str, *, timeout: float = TOOL_TIMEOUT,
                   fsck: bool = False, tool_path: str = TOOL_PATH) -> str:
    """Run one e2fsprogs tool with `timeout`; its stdout, or `ExpansionFailed`.

    ``e2fsck`` exits 1 or 2 after repairing something: success here (`fsck`)."""
    tool = Path(argv[0]).name
    proc = None
    with trio.move_on_after(timeout):
        try:
            proc = await trio.run_process(list(argv), capture_stdout=True,
                                          capture_stderr=True, check=False,
                                          env={"PATH": tool_path, "LC_ALL": "C"})
        except FileNotFoundError:
            raise ExpansionFailed(f"{tool} is not installed (e2fsprogs)",
                                  details={"step": step, "tool": tool}) from None
    if proc is None:
        raise DeadlineExceeded(f"{tool} did not finish within {timeout:.0f} s (step {step})",
                               details={"step": step, "tool": tool})
    out = proc.stdout.decode("utf-8", "replace")
    rc = proc.returncode
    if rc == 0 or (fsck and rc in (1, 2, 3)):
        return out
    text = (out + proc.stderr.decode("utf-8", "replace")).strip()[-_OUTPUT_TAIL:]
    raise ExpansionFailed(f"{tool} exited with {rc} (step {step}): {text}",
                          details={"step": step, "tool": tool, "exit_code": rc})


async def geometry(path: Path, *, timeout: float = TOOL_TIMEOUT,
                   tool_path: str = TOOL_PATH) -> Geometry:
    return parse_geometry(await run_tool(["dumpe2fs", "-h", str(path)], "geometry",
                                         timeout=timeout, tool_path=tool_path))


def _grow(path: Path, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
            os.fsync(fd)
    finally:
        os.close(fd)


async def expand_file(path: Path, target_bytes: int, *, progress: Progress,
                      tool_timeout: float = TOOL_TIMEOUT,
                      total_timeout: float = TOTAL_TIMEOUT,
                      tool_path: str = TOOL_PATH) -> Geometry:
    """Grow the ext4 file system in the block file `path` to `target_bytes` (see the
    module docstring); returns the final geometry.  Never shrinks (`InvalidArgument`).
    Raises `DeadlineExceeded` when a tool or the whole run takes too long."""
    with trio.move_on_after(total_timeout) as overall:
        result = await _expand(path, target_bytes, progress,
                               functools.partial(run_tool, timeout=tool_timeout,
                                                 tool_path=tool_path))
    if overall.cancelled_caught:
        raise DeadlineExceeded(f"the expansion did not finish within {total_timeout:.0f} s",
                               details={"step": "total"})
    return result


async def _expand(path: Path, target: int, progress: Progress,
                  tool: Callable[..., Awaitable[str]]) -> Geometry:
    size = (await trio.to_thread.run_sync(os.stat, path)).st_size
    if target < size:
        raise InvalidArgument(f"the block file is {size} bytes; an expansion to {target} "
                              "bytes would shrink it (block files never shrink)")
    await progress(CHECK)
    await tool(["e2fsck", "-f", "-y", str(path)], CHECK, fsck=True)
    failpoints.hit("node.expand.after-check")
    geo = parse_geometry(await tool(["dumpe2fs", "-h", str(path)], "geometry"))
    if target % geo.block_size:
        raise InvalidArgument(f"target {target} is not a multiple of the file system's "
                              f"block size {geo.block_size}")
    target_blocks = target // geo.block_size
    if target_blocks < geo.block_count:
        raise InvalidArgument(f"the file system has {geo.block_count * geo.block_size} "
                              f"bytes; {target} would shrink it")
    if geo.needs_resize_inode_removal(target_blocks):
        await progress(REMOVE_RESIZE_INODE)
        await tool(["tune2fs", "-O", "^resize_inode", str(path)], REMOVE_RESIZE_INODE)
        failpoints.hit("node.expand.after-tune2fs")
        await progress(RECHECK)
        await tool(["e2fsck", "-f", "-y", str(path)], RECHECK, fsck=True)
        failpoints.hit("node.expand.after-recheck")
    await progress(GROW_FILE)
    await trio.to_thread.run_sync(_grow, path, target)
    failpoints.hit("node.expand.after-grow-file")
    if target_blocks > geo.block_count:
        await progress(RESIZE)
        await tool(["resize2fs", str(path), f"{target // 1024}K"], RESIZE)
        failpoints.hit("node.expand.after-resize")
    return parse_geometry(await tool(["dumpe2fs", "-h", str(path)], "geometry"))
