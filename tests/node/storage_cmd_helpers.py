"""Pools and a `NodeStorage` for the storage-command tests, without an Instance manager:
real pool directories (marker + layout, as an operator's init and the node's start make
them), real `PoolObjects`, real e2fsprogs.  `debugfs` helpers put data into a block file
and read it back without mounting."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from kibotos.node.storage.objects import KINDS, PoolObjects
from kibotos.node.storage.pools.dirs import prepare_pool_dirs
from kibotos.node.storage.pools.marker import init_pool
from kibotos.node.storage.volume_ops import NodeStorage

MIB = 1 << 20
GIB = 1 << 30
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def make_pool(path: Path, pool_id: str) -> Path:
    init_pool(pool_id, path, adopt=True)
    prepare_pool_dirs(pool_id, path)
    return path


def pools_for(node_id: str, paths: dict[str, Path], *, receipt_wait: float = 1.0
              ) -> dict[tuple[str, str], PoolObjects]:
    return {(pid, kind): PoolObjects(pid, path, kind, node_id, receipt_wait=receipt_wait)
            for pid, path in paths.items() for kind in KINDS}


class Storage:
    """A `NodeStorage` of node `node_id` over `paths` (pool ID → directory)."""

    def __init__(self, node_id: str, paths: dict[str, Path], *, shared: bool = False,
                 **kwargs: Any) -> None:
        self.pools = pools_for(node_id, paths)
        self.retained: set[tuple[str, str, str]] = set()
        self.changes = 0

        def pool(pool_id: str, kind: str) -> PoolObjects:
            from kibotos.core.errors import FailedPrecondition
            try:
                return self.pools[(pool_id, kind)]
            except KeyError:
                raise FailedPrecondition(f"storage pool {pool_id} is not configured") from None

        def changed() -> None:
            self.changes += 1

        self.storage = NodeStorage(node_id=node_id, pool=pool, instances=list,
                                   shared_pools=dict.fromkeys(paths, shared),
                                   retained=self.retained, changed=changed, **kwargs)


def tree(root: Path) -> list[str]:
    """Every path under `root` (to show a refused command wrote nothing)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def debugfs(image: Path, *commands: str, write: bool = False) -> str:
    script = image.with_name(f".{image.name}.debugfs")
    script.write_text("\n".join(commands) + "\n")
    try:
        proc = subprocess.run(["debugfs", *(["-w"] if write else []), "-f", str(script),
                               str(image)], capture_output=True, env=ENV, check=True)
    finally:
        script.unlink()
    return proc.stdout.decode("utf-8", "replace")


def put_data(image: Path, workdir: Path) -> dict[str, bytes]:
    """A directory with a text file and a 3 MiB random file, written into the ext4
    block file with debugfs; returns path → content."""
    files = {"/hello.txt": b"hello from the layer\n",
             "/data/blob.bin": os.urandom(3 * MIB + 12345)}
    workdir.mkdir(parents=True, exist_ok=True)
    cmds = ["mkdir /data"]
    for name, content in files.items():
        local = workdir / name.strip("/").replace("/", "_")
        local.write_bytes(content)
        cmds.append(f"write {local} {name}")
    debugfs(image, *cmds, write=True)
    return files


def read_back(image: Path, name: str) -> bytes:
    """`debugfs -R 'cat NAME'` on the block file."""
    proc = subprocess.run(["debugfs", "-R", f"cat {name}", str(image)], capture_output=True,
                          env=ENV, check=True)
    return proc.stdout


def fsck_clean(image: Path) -> bool:
    return subprocess.run(["e2fsck", "-f", "-n", str(image)], capture_output=True,
                          env=ENV, check=False).returncode == 0


def dumpe2fs(image: Path) -> str:
    return subprocess.run(["dumpe2fs", "-h", str(image)], capture_output=True, env=ENV,
                          check=True).stdout.decode()
