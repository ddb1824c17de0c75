"""``POST /v1/transfers/export`` and ``/import`` through a real ctrl (hypercorn, SQLite)
with simulated nodes whose ``object.export``/``object.import`` are the real node code
(`kibotos.node.storage.transfer` on real pool directories, uploading to and downloading from
this ctrl's artifact store with the node's credential)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import trio
from transfer_sims import CAPACITY, TransferSim, node_pool, released_block_file
from volume_helpers import create_volume, settled_volume
from ws_helpers import events, open_ws_ctrl

from kibotos import transfer_archive
from kibotos.ctrl.wire.transfers import TransferExportOut, TransferImportOut
from kibotos.node.storage.objects import PoolObjects
from kibotos.node.storage.pools.dirs import prepare_pool_dirs
from kibotos.node.storage.transfer import NodeTransfers
from kibotos.testing.clock import ThreadAwareClock

MIB = 1 << 20
CAP = CAPACITY  # the block files transfer_sims makes


def read_manifest(path: Path) -> transfer_archive.Manifest:
    with open(path, "rb") as f:
        return transfer_archive.read_manifest(f)


async def block_file(path: Path, volume_id: str, epoch: int, node_id: str) -> bytes:
    """A released block file with some data (`released_block_file`); its bytes."""
    made = await released_block_file(path, volume_id, epoch, node_id,
                                     data=b"kept across the transfer" * 1000, offset=30 * MIB)
    return await trio.to_thread.run_sync(made.read_bytes)


async def test_export_then_import_on_another_node(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path, in_process=False) as ctrl:
        sim_a, pool_a = node_pool(tmp_path, ctrl, "node-a", TransferSim)
        sim_b, pool_b = node_pool(tmp_path, ctrl, "node-b", TransferSim)
        await ctrl.connect("node-a", sim=sim_a)
        await ctrl.connect("node-b", sim=sim_b)
        created = await create_volume(ctrl, pool_id="node-a-local", command_id="v-1",
                                      capacity_bytes=CAP)
        vid = created["volume_id"]
        assert (await settled_volume(ctrl, vid))["state"] == "AVAILABLE"
        content = await block_file(pool_a, vid, created["epoch"], "node-a")

        out = await ctrl.call("POST", "/v1/transfers/export",
                              json={"volume_id": vid, "command_id": "x-1"})
        TransferExportOut.model_validate(out)
        assert (out["volume_id"], out["pool_id"], out["node_id"], out["capacity_bytes"]) \
            == (vid, "node-a-local", "node-a", CAP)
        assert out["epoch"] == created["epoch"]  # a private pool's holder keeps it
        blob = ctrl.ctx.config.ctrl.state_dir / "artifacts" / "sha256" / \
            out["artifact_digest"].removeprefix("sha256:")
        assert blob.stat().st_size == out["size"] < 4 * MIB
        manifest = await trio.to_thread.run_sync(read_manifest, blob)
        assert (manifest.kind, manifest.object_id) == ("volume", vid)
        # a replay is the stored answer, no second export
        again = await ctrl.call("POST", "/v1/transfers/export",
                                json={"volume_id": vid, "command_id": "x-1"})
        assert again == out
        assert [c["kind"] for c in sim_a.commands].count("object.export") == 1
        assert any(e["kind"] == "transfer.exported" for e in await events(ctrl, vid))

        imp = await ctrl.call("POST", "/v1/transfers/import", json={
            "artifact_digest": out["artifact_digest"], "pool_id": "node-b-local",
            "labels": {"from": "node-a"}, "command_id": "i-1"})
        TransferImportOut.model_validate(imp)
        new = imp["volume"]
        assert (new["state"], new["pool_id"], new["capacity_bytes"], new["labels"]) == \
            ("AVAILABLE", "node-b-local", CAP, {"from": "node-a"})
        assert (imp["node_id"], imp["source_volume_id"]) == ("node-b", vid)
        assert new["volume_id"] != vid
        data = pool_b / "volumes" / "data" / f"{new['volume_id']}.ext4"
        assert await trio.to_thread.run_sync(data.read_bytes) == content
        # replay: same answer, the node is not asked again
        assert await ctrl.call("POST", "/v1/transfers/import", json={
            "artifact_digest": out["artifact_digest"], "pool_id": "node-b-local",
            "labels": {"from": "node-a"}, "command_id": "i-1"}) == imp
        assert [c["kind"] for c in sim_b.commands].count("object.import") == 1
        listed = await ctrl.call("GET", "/v1/volumes", params={"pool_id": "node-b-local"})
        assert [v["volume_id"] for v in listed["volumes"]] == [new["volume_id"]]
        # the imported Volume is an ordinary one: it can be deleted
        await ctrl.call("POST", f"/v1/volumes/{new['volume_id']}/delete", json={})
        assert (await settled_volume(ctrl, new["volume_id"]))["state"] == "DELETED"


async def test_refusals(tmp_path: Path, autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        sim_a, pool_a = node_pool(tmp_path, ctrl, "node-a", TransferSim)
        await ctrl.connect("node-a", sim=sim_a)
        await ctrl.call("POST", "/v1/transfers/export", json={"volume_id": "vol-nope"},
                        code="not_found")
        await ctrl.call("POST", "/v1/transfers/export", json={"volume_id": "Bad/ID"},
                        code="invalid_argument")
        await ctrl.call("POST", "/v1/transfers/import",
                        json={"artifact_digest": "sha256:" + "ab" * 32},
                        code="failed_precondition")
        await ctrl.call("POST", "/v1/transfers/import", json={"artifact_digest": "zz"},
                        code="invalid_argument")
        # an archive of a retained layer is not a Volume
        src = tmp_path / "layer.ext4"
        src.touch()
        os.truncate(src, 64 * MIB)
        buf = io.BytesIO()
        packed = transfer_archive.pack(src, {}, buf, kind="retained_layer", object_id="ws-1",
                                       source={})
        resp = await ctrl.http.put(f"/v1/artifacts/sha256/{packed.digest[7:]}",
                                   content=buf.getvalue(), headers=ctrl.operator)
        assert resp.status_code == 200, resp.text
        err = await ctrl.call("POST", "/v1/transfers/import",
                              json={"artifact_digest": packed.digest},
                              code="failed_precondition")
        assert "not a Volume" in str(err)
        # a Volume whose Workspace runs is not exported; nothing was sent to the node
        created = await create_volume(ctrl, pool_id="node-a-local")
        vid = created["volume_id"]
        await settled_volume(ctrl, vid)
        ws = await ctrl.create(volumes=[{"volume_id": vid}])
        await ctrl.settled(ws["workspace_id"])
        await ctrl.call("POST", "/v1/transfers/export", json={"volume_id": vid},
                        code="failed_precondition")
        assert not [c for c in sim_a.commands if c["kind"] == "object.export"]
        # a node that is not connected: unavailable, retry later
        await ctrl.action(ws["workspace_id"], "stop")
        await ctrl.settled(ws["workspace_id"])
        await ctrl.disconnect("node-a")
        with trio.fail_after(30):
            await ctrl.call("POST", "/v1/transfers/export", json={"volume_id": vid},
                            code="unavailable")
        assert pool_a.exists()


async def test_shared_pool_holder_is_released_after_the_export(tmp_path: Path) -> None:
    """As after a stop: in a shared pool nobody holds the Volume once the export ended,
    whether it succeeded or the node refused."""
    shared = [{"id": "shared", "shared": True, "default": True}]
    async with open_ws_ctrl(tmp_path, in_process=False) as ctrl:
        path = tmp_path / "shared"
        path.mkdir()
        prepare_pool_dirs("shared", path)
        sims = {}
        for node_id in ("node-a", "node-b"):
            def pool(pool_id: str, kind: str, node_id: str = node_id) -> PoolObjects:
                return PoolObjects(pool_id, path, kind, node_id, receipt_wait=0.5)
            sims[node_id] = TransferSim(transfers=NodeTransfers(
                node_id=node_id, pool=pool, ctrl_url=ctrl.url,
                credential=lambda node_id=node_id: ctrl.creds[node_id]))
            await ctrl.connect(node_id, sim=sims[node_id], pools=shared)
        created = await create_volume(ctrl, pool_id="shared", capacity_bytes=CAP)
        vid = created["volume_id"]
        assert (await settled_volume(ctrl, vid))["holder_node_id"] is None
        # the block file is missing: the node refuses, the use right is released
        err = await ctrl.call("POST", "/v1/transfers/export", json={"volume_id": vid},
                              code="not_found")
        assert vid in err["message"]
        assert (await settled_volume(ctrl, vid))["holder_node_id"] is None
        await block_file(path, vid, created["epoch"], created["holder_node_id"])
        out = await ctrl.call("POST", "/v1/transfers/export", json={"volume_id": vid})
        vol = await settled_volume(ctrl, vid)
        assert vol["holder_node_id"] is None
        assert vol["epoch"] == out["epoch"]
        # and any node of the shared pool imports it
        imp = await ctrl.call("POST", "/v1/transfers/import",
                              json={"artifact_digest": out["artifact_digest"]})
        assert imp["volume"]["pool_id"] == "shared"
        assert imp["volume"]["holder_node_id"] is None
