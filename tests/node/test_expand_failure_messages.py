"""The troubleshooting row "Expansion fails, and the message only says the expansion did
not complete or the file system could not be checked" (spec/storage-pools-on-nfs.txt):
what the command answers, the node log line ``storage object expansion failed`` with the
failed step and the tool's output, and that expanding again to the same target
continues from the block file's state.  The failing tools are stand-ins put in front of
the real e2fsprogs (their exit codes and messages are e2fsprogs'); the rerun uses the
real tools.  And the row after it: a root directory lost to an aborted resize2fs is
repaired by the next expansion into ``lost+found``."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
from storage_cmd_helpers import (
    ENV,
    MIB,
    Storage,
    fsck_clean,
    make_pool,
    put_data,
    read_back,
)

from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition
from kibotos.node.instances.commands import storage_handlers
from kibotos.node.storage import expand
from kibotos.node.storage.objects import VOLUMES


def stand_in(bindir: Path, tool: str, code: int, message: str) -> str:
    bindir.mkdir(exist_ok=True)
    script = bindir / tool
    script.write_text(f"#!/bin/sh\necho '{message}' >&2\nexit {code}\n")
    script.chmod(0o755)
    return f"{bindir}:{expand.TOOL_PATH}"


async def make_volume(pool: Path, tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    h = storage_handlers(Storage("node-a", {"pool-a": pool}).storage)
    await h["volume.create"]({"volume_id": "vol-1", "pool_id": "pool-a",
                              "capacity_bytes": 64 * MIB, "epoch": 1})
    image = pool / VOLUMES / "data" / "vol-1.ext4"
    return image, put_data(image, tmp_path / "src")


def expand_args(capacity: int) -> dict:
    return {"kind": "volume", "pool_id": "pool-a", "object_id": "vol-1", "epoch": 1,
            "capacity_bytes": capacity}


@pytest.mark.parametrize(("tool", "code", "output", "step", "words"), [
    ("e2fsck", 8, "e2fsck: Bad magic number in super-block while trying to open", "check",
     "the file system could not be checked"),
    ("resize2fs", 1, "resize2fs: Illegal doubly indirect block found while trying to resize",
     "resize", "the expansion did not complete"),
])
async def test_a_failed_tool_is_named_in_the_log_and_the_rerun_continues(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, tool: str, code: int, output: str,
        step: str, words: str) -> None:
    pool = make_pool(tmp_path / "pool-a", "pool-a")
    image, files = await make_volume(pool, tmp_path)
    target = 256 * MIB
    broken = Storage("node-a", {"pool-a": pool},
                     tool_path=stand_in(tmp_path / "bin", tool, code, output))
    with caplog.at_level(logging.INFO, logger="kibotos.node"), \
            pytest.raises(FailedPrecondition) as err:
        await storage_handlers(broken.storage)["object.expand"](expand_args(target))
    message = err.value.message
    assert message.startswith(f"volume vol-1 of pool pool-a: {words} (step {step}); "
                              f"expand again to {target} bytes or more to continue: ")
    assert f"{tool} exited with {code}" in message
    assert err.value.details == {"reason": "expansion_failed", "step": step,
                                 "target_bytes": target}
    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("storage object expansion failed"))
    for part in ("pool=pool-a", "object=vol-1", f"step={step}", f"target_bytes={target}",
                 output.split(":")[1].strip()):
        assert part in line, (part, line)
    meta = atomicfile.read_json(pool / VOLUMES / "metadata" / "vol-1.json")
    assert meta["expansion"]["step"] == step
    assert output.split(":")[1].strip() in meta["expansion"]["last_error"]
    assert meta["capacity_bytes"] == 64 * MIB

    fixed = Storage("node-a", {"pool-a": pool})  # the cause addressed: real tools
    result = await storage_handlers(fixed.storage)["object.expand"](expand_args(target))
    assert result == {"capacity_bytes": target}
    assert image.stat().st_size == target
    for name, content in files.items():
        assert read_back(image, name) == content
    assert fsck_clean(image)


def inode_of(image: Path, name: str) -> int:
    out = subprocess.run(["debugfs", "-R", f"stat {name}", str(image)], capture_output=True,
                         text=True, env=ENV, check=True).stdout
    return int(out.split("Inode:")[1].split()[0])


def clear_root_inode(image: Path) -> None:
    subprocess.run(["debugfs", "-w", "-R", "clri <2>", str(image)], capture_output=True,
                   env=ENV, check=True)


async def test_a_lost_root_directory_is_repaired_into_lost_and_found(
        tmp_path: Path) -> None:
    """The row "after an expansion that failed on v0.1.0-rc.2 or earlier … the files and
    directories that were in the root directory are gone": an aborted resize2fs had left
    the root directory unusable.  Here the root inode is cleared by hand (the same
    damage to the root directory); the next expansion's first step (``e2fsck -f -y``)
    repairs it, the expansion completes, and the entries are under ``lost+found``
    named ``#<inode>`` with their contents unchanged."""
    pool = make_pool(tmp_path / "pool-a", "pool-a")
    image, files = await make_volume(pool, tmp_path)
    hello, data_dir = inode_of(image, "/hello.txt"), inode_of(image, "/data")
    clear_root_inode(image)
    assert not fsck_clean(image)

    h = storage_handlers(Storage("node-a", {"pool-a": pool}).storage)
    assert await h["object.expand"](expand_args(256 * MIB)) == {"capacity_bytes": 256 * MIB}
    assert fsck_clean(image)
    assert read_back(image, f"/lost+found/#{hello}") == files["/hello.txt"]
    assert read_back(image, f"/lost+found/#{data_dir}/blob.bin") == files["/data/blob.bin"]
