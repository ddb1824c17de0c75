"""The troubleshooting row "Expansion fails, and the message only says the expansion did
not complete or the file system could not be checked" (spec/storage-pools-on-nfs.txt):
what the command answers, the node log line ``storage object expansion failed`` with the
failed step and the tool's output, and that expanding again to the same target
continues from the block file's state.  The failing tools are stand-ins put in front of
the real e2fsprogs (their exit codes and messages are e2fsprogs'); the rerun uses the
real tools."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from storage_cmd_helpers import MIB, Storage, fsck_clean, make_pool, put_data, read_back

from kibotos import atomicfile
from kibotos.errors import FailedPrecondition
from kibotos.node import expand
from kibotos.node.instance_spec import storage_handlers
from kibotos.node.objects import VOLUMES


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
