"""The node's attachment records (`kibotos.node.records.attachments`; spec: storage-pools-on-nfs,
"Directory layout": attachments are recorded under ``runtime/storage-pools/`` of the
node that attaches them, never in the pool): they appear before an object is opened
for an Instance and go after its release or fence; a node SIGKILLed between writing
the record and opening, or between the release and the removal, converges after a
restart; the start settles records against the Instance records; the SHA-256 rename at
start honours them; check-maintenance reports one with no owner; the local temporary
file sweep covers the directory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from adoption_harness import build_node, node_at, node_root, run_child
from instance_harness import registries, running_node

from kibotos.config import NodeConfig, PoolSection, parse
from kibotos.core import atomicfile, failpoints
from kibotos.core.errors import InvalidArgument
from kibotos.node.checks import maintenance_check
from kibotos.node.instances.contract import FAILED, RUNNING, STOPPED
from kibotos.node.records import instance_records as records
from kibotos.node.records.attachments import Attachments
from kibotos.node.storage.objects import RETAINED_LAYERS, VOLUMES, PoolObjects
from kibotos.node.storage.pools import legacy_names as ln
from kibotos.node.storage.pools import startup
from kibotos.node.storage.pools.dirs import prepare_pool_dirs
from kibotos.node.storage.pools.marker import init_pool

MIB = 1 << 20
ID = "inst-1"


def rec_path(root: Path, kind: str, object_id: str, pool: str = "pool-a") -> Path:
    return root / "runtime" / "storage-pools" / pool / kind / f"{object_id}.json"


def read(root: Path, kind: str, object_id: str) -> dict[str, Any] | None:
    path = rec_path(root, kind, object_id)
    if not path.exists():
        return None
    value = atomicfile.read_json(path)
    assert isinstance(value, dict)
    return value


def instance_record(root: Path, iid: str, *, state: str = "RUNNING", released: bool = False,
                    held: tuple[tuple[str, str, int], ...] = ()) -> None:
    d = root / "runtime" / "instances" / iid
    d.mkdir(parents=True, exist_ok=True)
    records.write_instance_record(d, {
        "state": state, "released": released,
        "held": [{"kind": k, "pool_id": "pool-a", "object_id": o, "epoch": e}
                 for k, o, e in held]})


async def make_volume(pool: Path, epoch: int = 1) -> None:
    vols = PoolObjects("pool-a", pool, VOLUMES, "node-a")
    await vols.open("vol-1", epoch, create_capacity=16 * MIB)
    assert vols.release("vol-1", epoch, confirmed_on_disk=True)


# ------------------------------------------------------------------ the record itself


def test_record_shape_owner_only_removal_and_bad_ids(tmp_path: Path) -> None:
    att = Attachments(tmp_path)
    att.record("pool-a", VOLUMES, "vol-1", instance_id="inst-1", epoch=3)
    value = read(tmp_path, VOLUMES, "vol-1")
    assert value is not None
    assert set(value) == {"instance_id", "epoch", "attached_at"}
    assert (value["instance_id"], value["epoch"]) == ("inst-1", 3)
    # a retry or an adoption keeps the record as it is; a new epoch rewrites it
    att.record("pool-a", VOLUMES, "vol-1", instance_id="inst-1", epoch=3)
    assert read(tmp_path, VOLUMES, "vol-1") == value
    att.record("pool-a", VOLUMES, "vol-1", instance_id="inst-1", epoch=4)
    assert read(tmp_path, VOLUMES, "vol-1")["epoch"] == 4  # type: ignore[index]
    att.record("pool-a", VOLUMES, "vol-1", instance_id="inst-1", epoch=3)
    # another Instance's release never drops it
    assert not att.remove("pool-a", VOLUMES, "vol-1", instance_id="inst-2")
    assert att.attached() == {("pool-a", VOLUMES, "vol-1")}
    assert att.remove("pool-a", VOLUMES, "vol-1", instance_id="inst-1")
    assert att.attached() == set()
    # a bad ID or kind is refused and nothing is written
    for args in [("pool-a", VOLUMES, "../x"), ("pool-a", "data", "vol-1"),
                 ("Pool A", VOLUMES, "vol-1")]:
        with pytest.raises(InvalidArgument):
            att.record(*args, instance_id="inst-1", epoch=1)
    with pytest.raises(InvalidArgument):
        att.record("pool-a", VOLUMES, "vol-2", instance_id="a/b", epoch=1)
    left = sorted(p.name for p in (tmp_path / "runtime" / "storage-pools").rglob("*")
                  if p.is_file())
    assert left == []


def test_an_interrupted_write_leaves_a_local_temporary_name(tmp_path: Path,
                                                            monkeypatch) -> None:
    """The temporary file has a local name (no node ID, spec table) and the start's
    local sweep deletes it; the record it would have replaced is intact."""
    pool = tmp_path / "pool"
    init_pool("pool-a", pool)
    cfg = parse(NodeConfig, {
        "node": {"id": "node-a", "ctrl_url": "http://127.0.0.1:9"},
        "storage": {"root": str(tmp_path / "root"),
                    "pool": [{"id": "pool-a", "path": str(pool)}]},
        "resources": {"cpu": 2, "memory": "1G"}}, "test")
    att = Attachments(cfg.storage.root)
    att.record("pool-a", VOLUMES, "vol-1", instance_id="inst-1", epoch=1)
    monkeypatch.setenv(failpoints.ENV, "atomic.before-rename=error")
    failpoints.reload()
    try:
        with pytest.raises(failpoints.FailpointError):
            att.record("pool-a", VOLUMES, "vol-1", instance_id="inst-1", epoch=2)
    finally:
        monkeypatch.delenv(failpoints.ENV)
        failpoints.reload()
    temps = [p for p in rec_path(cfg.storage.root, VOLUMES, "x").parent.iterdir()
             if p.name.startswith(".")]
    assert [p.name.startswith(".vol-1-") and p.name.endswith(".tmp") for p in temps] == [True]
    assert read(cfg.storage.root, VOLUMES, "vol-1")["epoch"] == 1  # type: ignore[index]
    startup.prepare(cfg)
    assert not any(p.exists() for p in temps)
    assert read(cfg.storage.root, VOLUMES, "vol-1")["epoch"] == 1  # type: ignore[index]


# ------------------------------------------------------------------ at start


def test_reconcile_follows_the_instance_records(tmp_path: Path) -> None:
    att = Attachments(tmp_path)
    # inst-1 holds vol-1: kept; its record does not hold vol-2 (a crash before the
    # Instance record caught up): deleted
    instance_record(tmp_path, "inst-1", held=((VOLUMES, "vol-1", 1),))
    att.record("pool-a", VOLUMES, "vol-1", instance_id="inst-1", epoch=1)
    att.record("pool-a", VOLUMES, "vol-2", instance_id="inst-1", epoch=1)
    # inst-2 released its objects (crash before the record went): deleted
    instance_record(tmp_path, "inst-2", state="STOPPING", released=True,
                    held=((RETAINED_LAYERS, "ws-2", 4),))
    att.record("pool-a", RETAINED_LAYERS, "ws-2", instance_id="inst-2", epoch=4)
    # inst-3 ended and its directory is gone: deleted
    att.record("pool-a", RETAINED_LAYERS, "ws-3", instance_id="inst-3", epoch=1)
    # inst-4's record is unreadable: kept (ownership unclear)
    (tmp_path / "runtime" / "instances" / "inst-4").mkdir(parents=True)
    (tmp_path / "runtime" / "instances" / "inst-4" / "instance.json").write_text("{")
    att.record("pool-a", RETAINED_LAYERS, "ws-4", instance_id="inst-4", epoch=1)
    # inst-5 was left by a node from before these records: its held objects get one
    instance_record(tmp_path, "inst-5", state="FAILED", held=((VOLUMES, "vol-5", 7),))

    done = Attachments(tmp_path).reconcile()
    assert sorted(a.object_id for a in done.deleted) == ["vol-2", "ws-2", "ws-3"]
    assert sorted(a.object_id for a in done.kept) == ["vol-1", "ws-4"]
    assert [(a.object_id, a.instance_id, a.epoch) for a in done.written] == \
        [("vol-5", "inst-5", 7)]
    assert att.attached() == {("pool-a", VOLUMES, "vol-1"), ("pool-a", VOLUMES, "vol-5"),
                              ("pool-a", RETAINED_LAYERS, "ws-4")}
    again = Attachments(tmp_path).reconcile()  # settled: nothing more to do
    assert (again.deleted, again.written) == ([], [])


def test_the_rename_at_start_keeps_what_an_old_node_left_attached(tmp_path: Path) -> None:
    """An Instance record from a node before attachment records holds an object still
    named by its SHA-256: the start writes its record, and the rename leaves it."""
    pool, root = tmp_path / "pool", tmp_path / "root"
    pool.mkdir()
    prepare_pool_dirs("pool-a", pool)
    for object_id in ("vol-att", "vol-free"):
        hexname = ln.digest_name(object_id)
        (pool / VOLUMES / "data" / f"{hexname}.ext4").write_bytes(b"x")
        atomicfile.write_json(pool / VOLUMES / "holders" / f"{hexname}.json",
                              {"node_id": "node-a", "epoch": 2})
        atomicfile.write_json(pool / VOLUMES / "metadata" / f"{hexname}.json",
                              {"version": 1, "kind": VOLUMES, "id": object_id})
    instance_record(root, "inst-1", held=((VOLUMES, "vol-att", 2),))
    Attachments(root).reconcile()
    section = PoolSection.model_validate({"id": "pool-a", "path": str(pool)})
    summary = ln.rename_at_start(section, "node-a", root)
    assert summary.renamed == [(VOLUMES, "vol-free")]
    assert summary.kept == [(VOLUMES, "vol-att")]
    # once the record goes (the release was recorded), the next start renames it
    assert Attachments(root).remove("pool-a", VOLUMES, "vol-att", instance_id="inst-1")
    assert ln.rename_at_start(section, "node-a", root).renamed == [(VOLUMES, "vol-att")]


# ------------------------------------------------------------------ a node's Instances


async def test_records_follow_attach_stop_destroy_and_fence() -> None:
    async with running_node(shared=True) as node:
        root = node.root
        await make_volume(node.pool)
        vol = [{"pool_id": "pool-a", "volume_id": "vol-1", "epoch": 1}]
        await node.command("instance.create", node.create_args(volumes=vol))
        await node.wait_state(ID, RUNNING)
        assert read(root, RETAINED_LAYERS, "ws-1")["instance_id"] == ID  # type: ignore[index]
        assert read(root, VOLUMES, "vol-1")["epoch"] == 1  # type: ignore[index]
        # nothing of it is in the pool
        assert not list(node.pool.rglob("*inst-1*"))
        await node.command("instance.stop", {"instance_id": ID, "force": False,
                                             "deadline_s": 10})
        assert read(root, RETAINED_LAYERS, "ws-1") is None
        assert read(root, VOLUMES, "vol-1") is None

        await node.command("instance.create", node.create_args("inst-2", volumes=vol))
        await node.wait_state("inst-2", RUNNING)
        assert read(root, VOLUMES, "vol-1")["instance_id"] == "inst-2"  # type: ignore[index]
        await node.command("instance.destroy", {"instance_id": "inst-2"})
        assert Attachments(root).attached() == set()

        await node.command("instance.create", node.create_args("inst-3", volumes=vol))
        await node.wait_state("inst-3", RUNNING)
        other = PoolObjects("pool-a", node.pool, VOLUMES, "node-b")
        await other.take("vol-1", 2, may_create=False)
        assert await node.holder_check().check() == ["inst-3"]
        await node.wait_state("inst-3", FAILED)
        assert Attachments(root).attached() == set()  # fenced: receipt, then no record
        await node.command("instance.stop", {"instance_id": "inst-3", "force": True})
        await node.wait_state("inst-3", STOPPED)


async def test_a_refused_open_leaves_no_record() -> None:
    async with running_node() as node:
        await make_volume(node.pool, epoch=5)  # held at a newer epoch than the command's
        await node.command("instance.create", node.create_args(
            volumes=[{"pool_id": "pool-a", "volume_id": "vol-1", "epoch": 1}]))
        frame = await node.wait_state(ID, FAILED)
        assert "use right was taken over" in frame["reason"]
        # the refusal came before anything was opened: neither object keeps a record
        assert node.manager.get(ID).held == []  # type: ignore[union-attr]
        assert Attachments(node.root).attached() == set()
        await node.command("instance.stop", {"instance_id": ID, "force": True})
        assert Attachments(node.root).attached() == set()


# ------------------------------------------------------------------ SIGKILL


@pytest.fixture
async def base() -> AsyncIterator[Path]:
    async with node_root("ar-") as path:
        yield path


def create_args(node_base: Path) -> dict[str, Any]:
    from instance_harness import write_template

    return {"instance_id": ID, "workspace_id": "ws-1", "template": write_template(node_base),
            "cpu_millis": 1000, "memory_bytes": 256 << 20,
            "layer": {"pool_id": "pool-a", "ref": "ws-1", "capacity_bytes": 64 << 20,
                      "epoch": 1, "create": True},
            "volumes": [], "launch": {"hostname": "box-1", "env": {}}}


@pytest.mark.slow
async def test_killed_between_the_record_and_the_open(base: Path) -> None:
    args = create_args(base)
    await run_child(base, [("instance.create", args)], "node.instance.after-attachment-record")
    root = base / "root"
    assert read(root, RETAINED_LAYERS, "ws-1")["instance_id"] == ID  # type: ignore[index]
    assert not (base / "pool" / RETAINED_LAYERS / "data" / "ws-1.ext4").exists()
    build_node(base)  # the start settles it: the Instance record does not hold it
    assert read(root, RETAINED_LAYERS, "ws-1") is None
    async with node_at(base) as node:  # the CREATING Instance boots again
        assert await node.command("instance.create", args) == {"accepted": True}
        await node.wait_state(ID, RUNNING)
        assert read(root, RETAINED_LAYERS, "ws-1")["instance_id"] == ID  # type: ignore[index]
        await node.manager.takeover.wait_idle()
        assert await node.command("instance.destroy", {"instance_id": ID}) == \
            {"destroyed": True}
        assert Attachments(root).attached() == set()


@pytest.mark.slow
async def test_killed_between_the_release_and_the_removal(base: Path) -> None:
    stop = {"instance_id": ID, "force": False, "deadline_s": 10}
    await run_child(base, [("instance.create", create_args(base)), ("wait", ID),
                           ("instance.stop", stop)], "node.instance.before-attachment-removal")
    root = base / "root"
    meta = atomicfile.read_json(base / "pool" / RETAINED_LAYERS / "metadata" / "ws-1.json")
    assert meta["state"] == "released"  # the release is recorded, the record still there
    assert read(root, RETAINED_LAYERS, "ws-1") is not None
    build_node(base)  # kept: the Instance record (STOPPING) still holds it
    assert read(root, RETAINED_LAYERS, "ws-1") is not None
    async with node_at(base) as node:
        result = await node.command("instance.stop", stop)  # ctrl repeats the stop
        assert set(result) == {"confirmed_on_disk"}
        assert node.manager.get(ID) is None
        assert Attachments(root).attached() == set()
        assert not list(root.rglob(".*.tmp"))


# ------------------------------------------------------------------ check-maintenance


async def test_check_maintenance_reports_a_record_with_no_owner(base: Path) -> None:
    async with running_node(base=base) as node:
        await node.command("instance.create", node.create_args())
        await node.wait_state(ID, RUNNING)
        await node.command("instance.stop", {"instance_id": ID, "force": False,
                                             "deadline_s": 10})
    report = await maintenance_check.run(node.config, "upgrade", registries=registries())
    assert report.exit_code == 0, report.render()
    Attachments(node.root).record("pool-a", VOLUMES, "vol-9", instance_id="inst-9", epoch=1)
    report = await maintenance_check.run(node.config, "upgrade", registries=registries())
    assert report.exit_code == 13, report.render()
    assert any("vol-9.json names Instance inst-9, which has no record on this node: a "
               "leftover with no owner" in line for line in report.of("blocked")), \
        report.render()
    rec_path(node.root, VOLUMES, "vol-9").write_text("{")
    report = await maintenance_check.run(node.config, "remove", registries=registries())
    assert any("attachment record of volumes vol-9 in storage pool pool-a: corrupted record"
               in line for line in report.of("blocked")), report.render()


async def test_an_open_cut_short_keeps_only_the_records_of_what_it_opened(monkeypatch
                                                                         ) -> None:
    """The writable layer opens, then the Volume's open fails (an I/O error at its
    attach record): the layer keeps its record (it is held until the stop), the Volume
    loses its own."""
    async with running_node() as node:
        await make_volume(node.pool)
        args = node.create_args(volumes=[{"pool_id": "pool-a", "volume_id": "vol-1",
                                          "epoch": 2}])
        # atomic writes of this create: instance.json, the two attachment records, the
        # two holder records, the new layer's metadata, its attach, the Volume's attach
        monkeypatch.setenv(failpoints.ENV, "atomic.before-rename=error@8")
        failpoints.reload()
        try:
            await node.command("instance.create", args)
            frame = await node.wait_state(ID, FAILED)
        finally:
            monkeypatch.delenv(failpoints.ENV)
            failpoints.reload()
        assert "failpoint atomic.before-rename" in frame["reason"]
        inst = node.manager.get(ID)
        assert inst is not None
        assert [h.object_id for h in inst.held] == ["ws-1"]
        assert Attachments(node.root).attached() == {("pool-a", RETAINED_LAYERS, "ws-1")}
        await node.command("instance.stop", {"instance_id": ID, "force": True})
        assert Attachments(node.root).attached() == set()
