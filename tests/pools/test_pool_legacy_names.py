"""SHA-256 names of versions before v0.1.0 renamed to IDs (spec: storage-pools-on-nfs,
"File names and object IDs"), and every row of "Same file under two names"."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kibotos.config import PoolSection
from kibotos.core import atomicfile, failpoints
from kibotos.core.errors import Unavailable
from kibotos.node.records.attachments import Attachments
from kibotos.node.storage.objects import RETAINED_LAYERS, VOLUMES, UseRightTakenOver
from kibotos.node.storage.pools import legacy_names as ln
from kibotos.node.storage.pools.dirs import prepare_pool_dirs

SUBS = {"locks": ".lock", "data": ".ext4", "holders": ".json", "releases": ".json",
        "metadata": ".json"}


def pool_section(path: Path, *, shared: bool = False, pool_id: str = "pool-a") -> PoolSection:
    return PoolSection.model_validate({"id": pool_id, "path": str(path), "shared": shared})


def old_object(pool: Path, object_id: str, *, kind: str = VOLUMES, holder: str | None =
               "node-a", epoch: int = 2, receipt: bool = True) -> str:
    """Files of an object as a version before v0.1.0 left them."""
    pool.mkdir(exist_ok=True)
    prepare_pool_dirs("pool-a", pool)
    hexname = hashlib.sha256(object_id.encode()).hexdigest()
    root = pool / kind
    (root / "locks" / f"{hexname}.lock").write_bytes(b"")
    with open(root / "data" / f"{hexname}.ext4", "wb") as f:
        f.truncate(1 << 20)
        f.write(b"payload of " + object_id.encode())
    if holder is not None:
        atomicfile.write_json(root / "holders" / f"{hexname}.json",
                              {"node_id": holder, "epoch": epoch})
        if receipt:
            atomicfile.write_json(root / "releases" / f"{hexname}.json",
                                  {"node_id": holder, "epoch": epoch})
    atomicfile.write_json(root / "metadata" / f"{hexname}.json", {
        "version": 1, "kind": kind, "id": object_id, "pool_id": "pool-a",
        "capacity_bytes": 1 << 20, "state": "released", "holder": holder, "epoch": epoch,
        "released_cleanly": True})
    return hexname


def names(pool: Path, kind: str = VOLUMES) -> dict[str, list[str]]:
    return {sub: sorted(os.listdir(pool / kind / sub)) for sub in SUBS}


def all_names(pool: Path) -> list[str]:
    return [n for listed in names(pool).values() for n in listed]


def objects(pool: Path, node: str = "node-a", kind: str = VOLUMES) -> ln.NamedPoolObjects:
    return ln.NamedPoolObjects("pool-a", pool, kind, node, receipt_wait=0.2)


def test_digest_name_is_the_sha256_of_the_id():
    out = subprocess.run("printf '%s' vol-06gb22twhsw9h7t04g99e42ndc | sha256sum", shell=True,
                         capture_output=True, text=True, check=True).stdout.split()[0]
    assert ln.digest_name("vol-06gb22twhsw9h7t04g99e42ndc") == out


def test_start_renames_unattached_objects_of_a_dedicated_pool(tmp_path: Path, caplog):
    pool = tmp_path / "pool"
    old_object(pool, "vol-1")
    old_object(pool, "vol-nobody", holder=None)  # no holder record: dedicated = ours
    old_object(pool, "ws-1", kind=RETAINED_LAYERS)
    with caplog.at_level(logging.INFO, logger="kibotos.node"):
        summary = ln.rename_at_start(pool_section(pool), "node-a", tmp_path / "root")
    assert sorted(summary.renamed) == [(RETAINED_LAYERS, "ws-1"), (VOLUMES, "vol-1"),
                                       (VOLUMES, "vol-nobody")]
    assert names(pool)["data"] == ["vol-1.ext4", "vol-nobody.ext4"]
    assert names(pool)["metadata"] == ["vol-1.json", "vol-nobody.json"]
    assert names(pool)["locks"] == ["vol-1.lock", "vol-nobody.lock"]
    assert names(pool, RETAINED_LAYERS)["holders"] == ["ws-1.json"]
    assert (pool / VOLUMES / "data" / "vol-1.ext4").read_bytes().startswith(b"payload of vol-1")
    assert [r.getMessage() for r in caplog.records
            if "node storage objects by name" in r.getMessage()] == \
        ["node storage objects by name pool=pool-a renamed=3 digest_names=0"]


def test_start_keeps_attached_and_foreign_objects(tmp_path: Path, caplog):
    pool, root = tmp_path / "pool", tmp_path / "root"
    attached_hex = old_object(pool, "vol-att")
    other_hex = old_object(pool, "vol-other", holder="node-b")
    # attached = this node's attachment record (kibotos.node.records.attachments)
    Attachments(root).record("pool-a", VOLUMES, "vol-att", instance_id="inst-1", epoch=2)
    with caplog.at_level(logging.INFO, logger="kibotos.node"):
        summary = ln.rename_at_start(pool_section(pool), "node-a", root)
    assert summary.renamed == []
    assert sorted(summary.kept) == [(VOLUMES, "vol-att"), (VOLUMES, "vol-other")]
    assert names(pool)["data"] == sorted([f"{attached_hex}.ext4", f"{other_hex}.ext4"])
    assert "node storage objects by name pool=pool-a renamed=0 digest_names=2" in caplog.text


async def test_attached_object_is_renamed_on_release(tmp_path: Path):
    pool = tmp_path / "pool"
    old_object(pool, "vol-att", epoch=2)
    objs = objects(pool)
    assert objs.release("vol-att", 2, confirmed_on_disk=True)
    assert names(pool)["data"] == ["vol-att.ext4"]
    assert names(pool)["metadata"] == ["vol-att.json"]
    meta = atomicfile.read_json(pool / VOLUMES / "metadata" / "vol-att.json")
    assert (meta["state"], meta["released_cleanly"]) == ("released", True)


def test_shared_pool_only_the_holder_renames(tmp_path: Path):
    pool = tmp_path / "pool"
    mine = old_object(pool, "vol-mine", holder="node-a")
    theirs = old_object(pool, "vol-theirs", holder="node-b")
    nobody = old_object(pool, "vol-nobody", holder=None)
    summary = ln.rename_at_start(pool_section(pool, shared=True), "node-a", tmp_path / "r")
    assert summary.renamed == [(VOLUMES, "vol-mine")]
    assert names(pool)["data"] == sorted([f"{nobody}.ext4", f"{theirs}.ext4",
                                          "vol-mine.ext4"])
    assert mine not in "".join(all_names(pool))


async def test_the_node_taking_over_renames_before_it_opens(tmp_path: Path):
    pool = tmp_path / "pool"
    old_object(pool, "vol-1", holder="node-a", epoch=2)
    opened = await objects(pool, "node-b").open("vol-1", 3)
    assert opened.path == pool / VOLUMES / "data" / "vol-1.ext4"
    assert opened.handoff_clean is True  # node-a's receipt was renamed with the rest
    assert all(not ln.DIGEST_NAME.fullmatch(n.split(".")[0])
               for n in all_names(pool))
    assert atomicfile.read_json(pool / VOLUMES / "holders" / "vol-1.json")["node_id"] == \
        "node-b"


async def test_an_older_epoch_than_an_old_named_holder_is_refused(tmp_path: Path):
    pool = tmp_path / "pool"
    hexname = old_object(pool, "vol-1", holder="node-b", epoch=5)
    before = names(pool)
    with pytest.raises(UseRightTakenOver, match="use right was taken over"):
        await objects(pool, "node-a").open("vol-1", 4)
    assert names(pool) == before
    assert f"{hexname}.json" in before["holders"]


def test_a_failed_step_stops_the_rename_and_logs(tmp_path: Path, monkeypatch, caplog):
    pool = tmp_path / "pool"
    old_object(pool, "vol-1", holder="node-a", epoch=2)
    monkeypatch.setenv(failpoints.ENV, "node.legacy-name.after-step=error")
    failpoints.reload()
    try:
        summary = ln.rename_at_start(pool_section(pool), "node-a", tmp_path / "r")
    finally:
        monkeypatch.delenv(failpoints.ENV)
        failpoints.reload()
    assert summary.kept == [(VOLUMES, "vol-1")]
    assert "node storage objects kept digest names" in caplog.text
    assert names(pool)["data"] == ["vol-1.ext4"]  # the first step after the lock is done
    assert names(pool)["metadata"] == [f"{ln.digest_name('vol-1')}.json"]


@pytest.mark.parametrize("done", [1, 2, 3, 4])
async def test_an_interrupted_rename_is_finished_by_the_next_user(tmp_path: Path, done: int):
    """The node exited after `done` of the five files moved (metadata is last, so it still
    has its old name and identifies the object): another node taking the object over
    finishes the rename; so would this node after a restart."""
    pool = tmp_path / "pool"
    old_object(pool, "vol-1", holder="node-a", epoch=2)
    for pair in ln.pairs(pool / VOLUMES, "vol-1")[:done]:
        assert ln.move_file(pair, "vol-1", "volume")
    assert names(pool)["metadata"] == [f"{ln.digest_name('vol-1')}.json"]
    assert ln.identify(pool / VOLUMES, ln.digest_name("vol-1"), {}) == "vol-1"
    opened = await objects(pool, "node-b").open("vol-1", 3)
    assert opened.handoff_clean is True
    assert names(pool)["metadata"] == ["vol-1.json"]
    assert names(pool)["data"] == ["vol-1.ext4"]
    assert not has_any_digest(pool)


def test_an_interrupted_rename_is_finished_at_the_next_start(tmp_path: Path):
    pool = tmp_path / "pool"
    old_object(pool, "vol-1", holder="node-a", epoch=2)
    for pair in ln.pairs(pool / VOLUMES, "vol-1")[:3]:
        ln.move_file(pair, "vol-1", "volume")
    summary = ln.rename_at_start(pool_section(pool, shared=True), "node-a", tmp_path / "r")
    assert summary.renamed == [(VOLUMES, "vol-1")]
    assert not has_any_digest(pool)


def test_a_move_cut_between_link_and_unlink_is_not_a_conflict(tmp_path: Path):
    pool = tmp_path / "pool"
    hexname = old_object(pool, "vol-1")
    data = pool / VOLUMES / "data"
    os.link(data / f"{hexname}.ext4", data / "vol-1.ext4")  # the same inode, both names
    summary = ln.rename_at_start(pool_section(pool), "node-a", tmp_path / "r")
    assert summary.renamed == [(VOLUMES, "vol-1")]
    assert names(pool)["data"] == ["vol-1.ext4"]


def test_unknown_digest_names_are_counted_not_touched(tmp_path: Path):
    pool = tmp_path / "pool"
    pool.mkdir()
    prepare_pool_dirs("pool-a", pool)
    stray = pool / VOLUMES / "data" / f"{'ab' * 32}.ext4"
    stray.write_bytes(b"x")
    summary = ln.rename_at_start(pool_section(pool), "node-a", tmp_path / "r")
    assert summary.kept == [(VOLUMES, "ab" * 32)]
    assert stray.exists()


# ------------------------------------------------------------ same file under two names


def _copy_under_new_name(pool: Path, sub: str, content: bytes | None = None) -> Path:
    new = pool / VOLUMES / sub / f"vol-1{SUBS[sub]}"
    if sub in ("holders", "releases"):
        atomicfile.write_json(new, {"node_id": "node-a", "epoch": 1})
    elif sub == "metadata":
        atomicfile.write_json(new, {"version": 1, "kind": VOLUMES, "id": "vol-1"})
    else:
        new.write_bytes(content or b"")
    return new


@pytest.mark.parametrize("sub", list(SUBS))
async def test_two_names_stop_the_rename_until_the_copy_is_moved(tmp_path: Path, caplog,
                                                                sub: str):
    """Each row of the table (locks/, holders/ or releases/, data/ or metadata/): the
    node renames nothing, logs the object, fails every operation retryably naming both
    files; once the extra copy is moved out, the next retry renames, no restart."""
    pool = tmp_path / "pool"
    hexname = old_object(pool, "vol-1", epoch=2)
    extra = _copy_under_new_name(pool, sub)
    before = names(pool)
    with caplog.at_level(logging.INFO, logger="kibotos.node"):
        summary = ln.rename_at_start(pool_section(pool), "node-a", tmp_path / "r")
    assert summary.renamed == []
    assert "vol-1" in summary.conflicts
    line = next(r.getMessage() for r in caplog.records
                if "node storage objects kept digest names" in r.getMessage())
    assert "object=vol-1" in line
    assert hexname in line
    assert "node storage objects by name pool=pool-a renamed=0 digest_names=1" in caplog.text
    assert names(pool) == before

    objs = objects(pool)
    old = pool / VOLUMES / sub / f"{hexname}{SUBS[sub]}"
    for attempt in (lambda: objs.delete("vol-1", 2),
                    lambda: objs.release("vol-1", 2, confirmed_on_disk=True)):
        with pytest.raises(Unavailable) as err:
            attempt()
        assert err.value.retryable
        assert str(old) in err.value.message
        assert str(extra) in err.value.message
        assert err.value.details["reason"] == "digest_name_conflict"
    with pytest.raises(Unavailable, match="same file under two names"):
        await objs.open("vol-1", 2)
    assert names(pool) == before  # nothing moved, nothing written

    os.rename(extra, tmp_path / "moved-away")  # the operator's fix
    opened = await objs.open("vol-1", 2)  # the next retry: renamed, opened
    assert opened.path.read_bytes().startswith(b"payload of vol-1")
    assert not has_any_digest(pool)


def has_any_digest(pool: Path) -> bool:
    return any(ln.DIGEST_NAME.fullmatch(n.split(".")[0]) for n in all_names(pool))


async def test_delete_of_an_old_named_object_renames_then_deletes(tmp_path: Path):
    pool = tmp_path / "pool"
    old_object(pool, "vol-1", epoch=2)
    assert objects(pool).delete("vol-1", 2)
    assert all_names(pool) == []


@pytest.mark.parametrize("point", ["node.legacy-name.after-link",
                                   "node.legacy-name.after-step"])
def test_a_node_killed_mid_rename_is_finished_at_its_next_start(tmp_path: Path, point: str):
    """SIGKILL inside the rename (between a link and its unlink, or between two files):
    the next start finishes it, and the same inode under both names is no conflict."""
    pool = tmp_path / "pool"
    old_object(pool, "vol-1", holder="node-a", epoch=2)
    code = ("import sys; from pathlib import Path; from kibotos.config import PoolSection; "
            "from kibotos.node.storage.pools.legacy_names import rename_at_start; "
            "rename_at_start(PoolSection.model_validate({'id': 'pool-a', 'path': sys.argv[1]}),"
            " 'node-a', Path(sys.argv[2]))")
    proc = subprocess.run([sys.executable, "-c", code, str(pool), str(tmp_path / "r")],
                          env={**os.environ, failpoints.ENV: f"{point}=kill"},
                          capture_output=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert has_any_digest(pool)
    summary = ln.rename_at_start(pool_section(pool), "node-a", tmp_path / "r")
    assert summary.renamed == [(VOLUMES, "vol-1")]
    assert not summary.conflicts
    assert not has_any_digest(pool)
    assert (pool / VOLUMES / "data" / "vol-1.ext4").read_bytes().startswith(b"payload")


def test_the_pool_monitor_renames_when_the_pool_is_first_available(tmp_path: Path, caplog):
    """Wired into the node's start: the first time a pool is seen available."""
    from kibotos.config import NodeConfig
    from kibotos.node.storage.pools import startup
    from kibotos.node.storage.pools.marker import init_pool
    from kibotos.plugins import load_plugins

    pool = tmp_path / "pool"
    old_object(pool, "vol-1")
    cfg = NodeConfig.model_validate({
        "node": {"id": "node-a", "ctrl_url": "http://127.0.0.1:1"},
        "storage": {"root": str(tmp_path / "root"),
                    "pool": [{"id": "pool-a", "path": str(pool)}]},
        "resources": {"cpu": 1, "memory": "1G"},
        "host": {"proc_root": "/proc", "sys_root": "/sys"}})
    mon = startup.monitor(cfg, load_plugins().storage_driver)
    with caplog.at_level(logging.INFO, logger="kibotos.node"):
        mon.refresh()  # no marker yet: unavailable, nothing renamed
        assert has_any_digest(pool)
        init_pool("pool-a", pool, adopt=True)
        mon.refresh()
    assert not has_any_digest(pool)
    assert "node storage objects by name pool=pool-a renamed=1 digest_names=0" in caplog.text
