"""The node's records of ended Instances and preparation commands
(`kibotos.node.records.registry`), the machine-log tails with their quota
(`kibotos.node.records.machine_logs`), and the node-local temporary files deleted at start
(spec: node-and-vmm-processes, "Records of ended Instances", "Console and VMM logs",
"Temporary files from interrupted writes", local rows of both tables)."""

from __future__ import annotations

import logging
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from instance_harness import running_node
from node_helpers import node_config

from kibotos.core import atomicfile
from kibotos.core.errors import InvalidArgument
from kibotos.node.instances.contract import STOPPED
from kibotos.node.instances.lifecycle import Instance
from kibotos.node.records import instance_records as records
from kibotos.node.records import machine_logs
from kibotos.node.records.instance_dirs import InstanceDirs
from kibotos.node.records.registry import LIST_LIMIT, Registry, cleanup_result, registry_handlers
from kibotos.node.storage.pools import startup as pools_startup
from kibotos.protocol import CreateSpec


def _write(registry: Registry, instance_id: str, age_s: float) -> None:
    registry.write(instance_id, {"workspace_id": "ws-1", "state": "STOPPED",
                                 "confirmed_on_disk": True, "ended_at": "t",
                                 "cleanup": cleanup_result("2026-01-01T00:00:00+00:00")})
    path = registry.dir / f"{instance_id}.json"
    then = path.stat().st_mtime - age_s
    os.utime(path, (then, then))


async def test_list_gives_the_oldest_records_first_and_says_when_there_are_more(
        tmp_path: Path) -> None:
    registry = Registry(tmp_path / "registry")
    for n in range(LIST_LIMIT + 3):
        _write(registry, f"inst-{n:03d}", age_s=1000 - n)
    handlers = registry_handlers(registry)
    first = await handlers["registry.list"]({})
    assert len(first["entries"]) == LIST_LIMIT
    assert first["more"] is True
    assert [e["instance_id"] for e in first["entries"][:2]] == ["inst-000", "inst-001"]
    assert first["entries"][0]["cleanup"] == {
        "RUNTIME": "RELEASED", "VOLUME_ATTACHMENT": "RELEASED", "RESIDUAL": "RELEASED",
        "observed_at": "2026-01-01T00:00:00+00:00"}

    gone = [e["instance_id"] for e in first["entries"]]
    assert (await handlers["registry.delete"]({"instance_ids": gone}))["deleted"] == gone
    assert (await handlers["registry.delete"]({"instance_ids": gone}))["deleted"] == []
    rest = await handlers["registry.list"]({"limit": 5})
    assert [e["instance_id"] for e in rest["entries"]] == [
        f"inst-{n:03d}" for n in range(LIST_LIMIT, LIST_LIMIT + 3)]
    assert rest["more"] is False


async def test_bad_arguments_are_refused_and_nothing_is_deleted(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "registry")
    _write(registry, "inst-1", 0)
    handlers = registry_handlers(registry)
    for args, field in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                        ({"other": 1}, "other")):
        with pytest.raises(InvalidArgument, match=f"registry.list: {field}"):
            await handlers["registry.list"](args)
    for args, field in (({"instance_ids": ["../etc/passwd"]}, "instance_ids.0"),
                        ({"instance_ids": [f"inst-{n}" for n in range(101)]},
                         "instance_ids"), ({}, "instance_ids")):
        with pytest.raises(InvalidArgument, match=f"registry.delete: {field}"):
            await handlers["registry.delete"](args)
    assert (registry.dir / "inst-1.json").is_file()


def test_volume_commands_are_kept_24_hours(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "registry")
    now = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    registry.record_volume_command("layer.delete", "pool-a/lay-1", {"deleted": True},
                                   now=now - timedelta(hours=23))
    registry.record_volume_command("layer.delete", "pool-a/lay-2", {"deleted": True},
                                   now=now - timedelta(hours=25))
    assert registry.volume_command("layer.delete", "pool-a/lay-1", now=now) == \
        {"deleted": True}
    assert registry.volume_command("layer.delete", "pool-a/lay-2", now=now) is None
    assert registry.prune_volume_commands(now=now) == 1
    kept = atomicfile.read_json(registry.dir / "volume-commands.json")["entries"]
    assert [e["key"] for e in kept] == ["pool-a/lay-1"]
    # The file is not an Instance record.
    assert registry.entries()[0] == []
    assert registry.prune_volume_commands(now=now + timedelta(hours=2)) == 1
    assert atomicfile.read_json(registry.dir / "volume-commands.json")["entries"] == []


def _runtime(tmp_path: Path, name: str, console: bytes, vmm: bytes) -> Path:
    d = tmp_path / "runtime" / name
    d.mkdir(parents=True)
    (d / "console.log").write_bytes(console)
    (d / "vmm.log").write_bytes(vmm)
    return d


def test_log_tails_are_kept_once_and_the_quota_removes_the_oldest(tmp_path: Path) -> None:
    logs = tmp_path / "machine-logs"
    logs.mkdir()
    big = b"x" * 300_000
    first = _runtime(tmp_path, "inst-1", b"early\n" + big + b"last console line\n",
                     b"vmm says bye\n")
    sizes = machine_logs.keep_tails(first, logs / "inst-1")
    assert sizes == {"console.log": machine_logs.TAIL_BYTES, "vmm.log": 13}
    assert (logs / "inst-1" / "console.log").read_bytes().endswith(b"last console line\n")
    assert b"early" not in (logs / "inst-1" / "console.log").read_bytes()
    # A second pass (a node restarted before the runtime directory went) keeps it.
    assert machine_logs.keep_tails(first, logs / "inst-1") is None

    old = os.stat(logs / "inst-1").st_mtime - 100
    os.utime(logs / "inst-1", (old, old))
    second = _runtime(tmp_path, "inst-2", big, b"")
    machine_logs.keep_tails(second, logs / "inst-2")
    (logs / ".inst-9-1.tmp").mkdir()  # a copy a dead node process left
    removed = machine_logs.enforce_quota(logs, 400_000, keep="inst-2")
    assert removed == ["inst-1"]
    assert sorted(os.listdir(logs)) == ["inst-2"]
    # The one just written stays, even alone over the quota.
    assert machine_logs.enforce_quota(logs, 1, keep="inst-2") == []


def test_node_local_temporary_files_are_deleted_at_start(tmp_path: Path) -> None:
    config = node_config(tmp_path)
    root = config.storage.root
    temp = [root / "runtime" / "registry" / ".record-2826134621.tmp",
            root / "runtime" / "registry" / ".inst-1-77.tmp",
            root / "runtime" / "instances" / "inst-2" / ".instance-3.tmp",
            root / "runtime" / ".node-4.tmp",
            root / "machine-logs" / "inst-3" / ".console-5.tmp",
            root / "template-cache" / "sha256" / ".0123abcd-6.tmp",
            root / "state" / ".incarnation-7.tmp"]
    kept = [root / "runtime" / "registry" / "inst-1.json",
            root / "runtime" / "registry" / "volume-commands.json",
            root / "runtime" / "instances" / "inst-2" / "instance.json",
            root / "machine-logs" / "inst-3" / "console.log",
            root / "state" / "incarnation", root / "runtime" / ".keep"]
    for path in temp + kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    staging = root / "machine-logs" / ".inst-4-12345.tmp"
    staging.mkdir()
    (staging / "console.log").write_text("half a copy")

    pools_startup.prepare(config)  # what serve_node does at start
    InstanceDirs(root)  # the Instance manager's construction
    assert [p for p in temp if p.exists()] == []
    assert [p for p in kept if not p.exists()] == []
    assert not staging.exists()


async def test_preparation_commands_are_recorded_in_volume_commands() -> None:
    async with running_node() as node:
        result = await node.command("layer.delete", {"pool_id": "pool-a", "ref": "ws-9",
                                                     "epoch": 1})
        assert result == {"deleted": True}
        entries = atomicfile.read_json(node.root / "runtime" / "registry" /
                                       "volume-commands.json")["entries"]
        assert [(e["kind"], e["key"], e["result"]) for e in entries] == [
            ("layer.delete", "pool-a/ws-9", {"deleted": True})]
        # Other commands are not preparation commands.
        await node.command("node.drain", {"requested": False})
        assert len(atomicfile.read_json(node.root / "runtime" / "registry" /
                                        "volume-commands.json")["entries"]) == 1


def test_an_end_cut_short_by_a_crash_is_finished_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The node died after the registry entry and the log tails, before the runtime
    directory went: the next start removes the directory and keeps the first entry
    (its observation time) and the single ``instance machine exited`` line."""
    caplog.set_level(logging.INFO, logger="kibotos.node")
    dirs = InstanceDirs(tmp_path / "root")
    spec = CreateSpec.model_validate({
        "instance_id": "inst-1", "workspace_id": "ws-1",
        "template": {"name": "tiny", "image_digest": "sha256:" + "a" * 64,
                     "kernel_digest": "sha256:" + "b" * 64,
                     "initramfs_digest": "sha256:" + "c" * 64},
        "cpu_millis": 1000, "memory_bytes": 128 << 20,
        "layer": {"pool_id": "pool-a", "ref": "ws-1", "capacity_bytes": 64 << 20,
                  "epoch": 1}, "volumes": [], "launch": {}})
    inst = Instance(spec=spec, dir=dirs.dir_for("inst-1"))
    dirs.make(inst)
    (inst.dir / "console.log").write_text("guest says bye\n")
    inst.state = STOPPED
    dirs.remove(inst)
    first = dirs.ended("inst-1")
    assert first is not None
    # As if the crash came before the directory was removed.
    inst.dir.mkdir(parents=True)
    records.write_instance_record(inst.dir, inst.to_record())
    assert dirs.read_all() == []
    assert not inst.dir.exists()
    assert dirs.ended("inst-1") == first
    exited = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith("instance machine exited ")]
    assert len(exited) == 1
    assert (dirs.machine_logs / "inst-1" / "console.log").read_text() == "guest says bye\n"
