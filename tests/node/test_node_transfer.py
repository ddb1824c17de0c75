"""``object.export`` / ``object.import`` against a real ctrl (hypercorn on loopback,
SQLite): the archive goes through ctrl's artifact store with the node's credential,
staging files are gone when the command ends, and an import on another node and pool
gives the same block file."""

from __future__ import annotations

import hashlib
import io
import os
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio
from artifact_ctrl_harness import loopback_ctrl
from instance_harness import running_node

from kibotos import transfer_archive
from kibotos.core import atomicfile
from kibotos.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from kibotos.node.instances.commands import transfer_handlers
from kibotos.node.storage.objects import RETAINED_LAYERS, VOLUMES, PoolObjects, UseRightTakenOver
from kibotos.node.storage.pools.dirs import prepare_pool_dirs
from kibotos.node.storage.pools.tempfiles import is_temp_name
from kibotos.node.storage.transfer import NodeTransfers

MIB = 1 << 20


@dataclass
class Ctrl:
    url: str
    operator: dict[str, str]
    credentials: dict[str, str]
    artifacts: Path
    ca_file: Path  # the cluster CA, which verifies ctrl's certificate
    tls: ssl.SSLContext


@pytest.fixture
async def ctrl(tmp_path: Path) -> AsyncIterator[Ctrl]:
    async with loopback_ctrl(tmp_path, ("node-a", "node-b")) as c:
        yield Ctrl(c.url, c.operator, c.credentials, c.artifacts, c.ca_file, c.tls)


def pool_objects(path: Path, pool_id: str, node: str, *, unavailable: str | None = None
                 ) -> dict[tuple[str, str], PoolObjects]:
    path.mkdir(exist_ok=True)
    prepare_pool_dirs(pool_id, path)
    return {(pool_id, kind): PoolObjects(pool_id, path, kind, node, receipt_wait=0.2,
                                         unavailable=lambda: unavailable)
            for kind in (VOLUMES, RETAINED_LAYERS)}


def transfers(ctrl: Ctrl, node: str, pools: dict[tuple[str, str], PoolObjects]
              ) -> NodeTransfers:
    def pool(pool_id: str, kind: str) -> PoolObjects:
        if (pool_id, kind) not in pools:
            raise FailedPrecondition(f"pool {pool_id} is not configured on {node}")
        return pools[(pool_id, kind)]
    return NodeTransfers(node_id=node, pool=pool, ctrl_url=ctrl.url,
                         credential=lambda: ctrl.credentials[node], verify=ctrl.tls)


def leftovers(pool: Path) -> list[str]:
    return sorted(str(p.relative_to(pool)) for p in pool.rglob(".*") if p.is_file()
                  and p.name != ".kibotos-storage-pool")


async def make_volume(objs: PoolObjects, volume_id: str = "vol-1", epoch: int = 1) -> bytes:
    opened = await objs.open(volume_id, epoch, create_capacity=64 * MIB)
    fd = os.open(opened.path, os.O_WRONLY)
    try:
        os.pwrite(fd, os.urandom(256 << 10), 50 * MIB)
    finally:
        os.close(fd)
    assert objs.release(volume_id, epoch, confirmed_on_disk=True)
    return opened.path.read_bytes()


async def test_export_then_import_on_another_node_and_pool(ctrl: Ctrl, tmp_path: Path):
    a_pools = pool_objects(tmp_path / "pool-a", "pool-a", "node-a")
    b_pools = pool_objects(tmp_path / "pool-b", "pool-b", "node-b")
    content = await make_volume(a_pools[("pool-a", VOLUMES)])
    node_a, node_b = transfers(ctrl, "node-a", a_pools), transfers(ctrl, "node-b", b_pools)
    out = await node_a.export("volume", "pool-a", "vol-1", 2)
    stored = ctrl.artifacts / out["artifact_digest"].removeprefix("sha256:")
    assert stored.stat().st_size == out["size"]
    assert hashlib.sha256(stored.read_bytes()).hexdigest() == \
        out["artifact_digest"].removeprefix("sha256:")
    assert out["size"] < 2 * MIB  # holes are not carried
    assert leftovers(tmp_path / "pool-a") == []  # staging deleted at the end
    src = a_pools[("pool-a", VOLUMES)]
    assert (src.holder("vol-1").epoch, src.metadata("vol-1")["state"]) == (2, "released")
    # a retry is the same artifact
    assert (await node_a.export("volume", "pool-a", "vol-1", 2)) == out

    got = await node_b.import_("volume", "pool-b", "vol-2", out["artifact_digest"], 5)
    assert got == {"imported": True}
    dst = b_pools[("pool-b", VOLUMES)]
    block = dst.data_path("vol-2")
    assert block.read_bytes() == content
    assert block.stat().st_blocks * 512 < 16 * MIB  # sparse, like the source
    meta = dst.metadata("vol-2")
    assert (meta["id"], meta["pool_id"], meta["capacity_bytes"], meta["state"],
            meta["released_cleanly"]) == ("vol-2", "pool-b", 64 * MIB, "released", True)
    assert meta["imported_from"]["artifact_digest"] == out["artifact_digest"]
    assert (meta["imported_from"]["object_id"], meta["imported_from"]["pool_id"],
            meta["imported_from"]["epoch"]) == ("vol-1", "pool-a", 2)
    assert dst.release_receipt("vol-2").epoch == 5
    assert leftovers(tmp_path / "pool-b") == []
    # any node of the pool opens it at that epoch or newer, without waiting
    other = PoolObjects("pool-b", tmp_path / "pool-b", VOLUMES, "node-c", receipt_wait=30)
    with trio.fail_after(20):
        opened = await other.open("vol-2", 6)
    assert opened.handoff_clean is True

    # a repeat is answered from the metadata; another object under the ID is refused
    assert await node_b.import_("volume", "pool-b", "vol-2", out["artifact_digest"], 5) \
        == {"imported": True}
    await make_volume(a_pools[("pool-a", VOLUMES)], "vol-3")
    third = await node_a.export("volume", "pool-a", "vol-3", 2)
    with pytest.raises(AlreadyExists, match="vol-2 already exists"):
        await node_b.import_("volume", "pool-b", "vol-2", third["artifact_digest"], 5)


async def test_export_refusals_write_nothing(ctrl: Ctrl, tmp_path: Path):
    pools = pool_objects(tmp_path / "pool-a", "pool-a", "node-a")
    await make_volume(pools[("pool-a", VOLUMES)], epoch=3)
    node = transfers(ctrl, "node-a", pools)
    with pytest.raises(UseRightTakenOver):
        await node.export("volume", "pool-a", "vol-1", 2)
    with pytest.raises(NotFound):
        await node.export("volume", "pool-a", "vol-9", 3)
    with pytest.raises(FailedPrecondition, match="not configured"):
        await node.export("volume", "pool-x", "vol-1", 3)
    assert leftovers(tmp_path / "pool-a") == []
    assert list(ctrl.artifacts.iterdir()) == []


async def test_import_refusals_write_nothing(ctrl: Ctrl, tmp_path: Path):
    pools = pool_objects(tmp_path / "pool-b", "pool-b", "node-b")
    node = transfers(ctrl, "node-b", pools)
    pool_dir = tmp_path / "pool-b"
    with pytest.raises(FailedPrecondition, match="not in ctrl's artifact store"):
        await node.import_("volume", "pool-b", "vol-1", "sha256:" + "ab" * 32, 1)
    # a retained layer's archive is not a Volume
    src = tmp_path / "layer.ext4"
    src.touch()
    os.truncate(src, 4 * MIB)
    buf = io.BytesIO()
    packed = transfer_archive.pack(src, {}, buf, kind="retained_layer", object_id="ws-1",
                                   source={})
    async with httpx.AsyncClient(base_url=ctrl.url, verify=ctrl.tls) as http:
        resp = await http.put(f"/v1/artifacts/sha256/{packed.digest[7:]}",
                              content=buf.getvalue(), headers=ctrl.operator)
        assert resp.status_code == 200, resp.text
        junk = b"not an archive"
        junk_hex = hashlib.sha256(junk).hexdigest()
        await http.put(f"/v1/artifacts/sha256/{junk_hex}", content=junk,
                       headers=ctrl.operator)
    with pytest.raises(InvalidArgument, match="holds a retained_layer"):
        await node.import_("volume", "pool-b", "vol-1", packed.digest, 1)
    with pytest.raises(InvalidArgument, match="not a kibotos Transfer archive"):
        await node.import_("volume", "pool-b", "vol-1", junk_hex, 1)
    assert leftovers(pool_dir) == []
    assert [p for sub in ("data", "metadata", "holders", "releases")
            for p in (pool_dir / VOLUMES / sub).iterdir()] == []
    # the right kind imports
    assert await node.import_("retained_layer", "pool-b", "ws-1", packed.digest, 1) == \
        {"imported": True}


async def test_unavailable_pool_and_unreachable_ctrl(ctrl: Ctrl, tmp_path: Path):
    pools = pool_objects(tmp_path / "pool-a", "pool-a", "node-a", unavailable="marker gone")
    node = transfers(ctrl, "node-a", pools)
    with pytest.raises(Unavailable, match="storage pool is unavailable"):
        await node.export("volume", "pool-a", "vol-1", 1)
    up = pool_objects(tmp_path / "pool-c", "pool-c", "node-a")
    await make_volume(up[("pool-c", VOLUMES)])
    away = NodeTransfers(node_id="node-a", pool=lambda p, k: up[(p, k)],
                         ctrl_url="http://127.0.0.1:9", credential=lambda: "x")
    with pytest.raises(Unavailable, match="cannot reach ctrl"):
        await away.export("volume", "pool-c", "vol-1", 1)
    assert leftovers(tmp_path / "pool-c") == []
    meta = up[("pool-c", VOLUMES)].metadata("vol-1")
    assert meta["state"] == "released"  # released before the upload was tried


async def test_handlers_check_arguments_before_anything(ctrl: Ctrl, tmp_path: Path):
    pools = pool_objects(tmp_path / "pool-a", "pool-a", "node-a")
    handlers = transfer_handlers(transfers(ctrl, "node-a", pools))
    assert set(handlers) == {"object.export", "object.import"}
    for bad, needle in (({"kind": "volume", "pool_id": "pool-a", "object_id": "..",
                          "epoch": 1}, "object_id"),
                        ({"kind": "disk", "pool_id": "pool-a", "object_id": "vol-1",
                          "epoch": 1}, "kind"),
                        ({"kind": "volume", "pool_id": "pool-a", "object_id": "V" * 33,
                          "epoch": 1}, "object_id"),
                        ({"kind": "volume", "pool_id": "pool-a", "object_id": "vol-1",
                          "epoch": 1, "extra": 1}, "unknown field")):
        with pytest.raises(InvalidArgument, match=needle):
            await handlers["object.export"](bad)
    with pytest.raises(InvalidArgument, match="artifact_digest: invalid digest"):
        await handlers["object.import"]({"kind": "volume", "pool_id": "pool-a",
                                         "object_id": "vol-1", "artifact_digest": "zz",
                                         "epoch": 1})
    assert leftovers(tmp_path / "pool-a") == []


def test_staging_and_temporary_names_are_swept_at_start():
    for name in (".node-a.export-12.tar", ".node-a.download-import-3170412187.tar",
                 ".node-a.import-1438876543.tmp"):
        assert is_temp_name(name), name
    assert atomicfile  # the records go through atomicfile (PoolObjects._write)


async def test_commands_through_the_running_node(ctrl: Ctrl):
    """The manager registers both commands when it has a credential; a Volume a live
    Instance holds is not exported; after the stop it is, and imports under a new ID."""
    async with running_node(ctrl_url=ctrl.url, credential=ctrl.credentials["node-a"],
                            ctrl_ca_file=ctrl.ca_file) as node:
        vol = {"volume_id": "vol-1", "pool_id": "pool-a", "capacity_bytes": 64 * MIB,
               "epoch": 1}
        assert await node.command("volume.create", vol) == {"created": True}
        args = node.create_args(volumes=[{"volume_id": "vol-1", "pool_id": "pool-a",
                                          "epoch": 1, "mount_point": "/data"}])
        assert await node.command("instance.create", args) == {"accepted": True}
        await node.wait_state("inst-1", "RUNNING")
        export = {"kind": "volume", "pool_id": "pool-a", "object_id": "vol-1", "epoch": 1}
        with pytest.raises(FailedPrecondition, match="in use by Instance inst-1"):
            await node.command("object.export", export)
        await node.command("instance.stop", {"instance_id": "inst-1"})
        out = await node.command("object.export", export)
        assert set(out) == {"artifact_digest", "size"}
        assert await node.command("object.import", {
            "kind": "volume", "pool_id": "pool-a", "object_id": "vol-2", "epoch": 1,
            "artifact_digest": out["artifact_digest"]}) == {"imported": True}
        data = node.pool / "volumes" / "data"
        assert (data / "vol-2.ext4").read_bytes() == (data / "vol-1.ext4").read_bytes()
        assert node.manager.holdings().volume_count >= 2  # private pool: both held here
        assert leftovers(node.pool) == []


async def test_a_takeover_during_the_export_uploads_nothing(ctrl: Ctrl, tmp_path: Path,
                                                            monkeypatch):
    """Another node granted a newer epoch while the block file was read (it may have
    written meanwhile): the export fails as taken over, and no archive reaches ctrl."""
    pools = pool_objects(tmp_path / "pool-a", "pool-a", "node-a")
    await make_volume(pools[("pool-a", VOLUMES)])
    real_pack = transfer_archive.pack

    def pack_while_taken_over(*args, **kwargs):
        atomicfile.write_json(tmp_path / "pool-a" / VOLUMES / "holders" / "vol-1.json",
                              {"node_id": "node-b", "epoch": 3})  # node-b's takeover
        return real_pack(*args, **kwargs)

    monkeypatch.setattr(transfer_archive, "pack", pack_while_taken_over)
    node = transfers(ctrl, "node-a", pools)
    with pytest.raises(UseRightTakenOver, match="while it was being exported"):
        await node.export("volume", "pool-a", "vol-1", 2)
    assert list(ctrl.artifacts.iterdir()) == []
    assert leftovers(tmp_path / "pool-a") == []
