"""Runtime installations (spec: node-and-vmm-processes, "Launch records and adoption"):
pinned at start, recorded in every launch record, kept or refused for an Instance an
earlier build started, pruned at start except those still recorded."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
from instance_harness import short_dir
from kibotos_qemu.backend import QemuVmm
from upgrade_harness import node_at, start, stop_units

from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition
from kibotos.node.runtime import installations as inst_mod
from kibotos.node.runtime.build_identity import BuildIdentity, runtime_range_problem

N = BuildIdentity(release="0.4.0")
N1 = BuildIdentity(release="0.4.1")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


def test_pin_copies_the_runtime_with_its_manifest(root: Path) -> None:
    pinned = inst_mod.pin(root, N)
    assert pinned.path == root / "installations" / pinned.identity
    manifest = json.loads((pinned.path / "installation.json").read_text())
    assert manifest["format"] == inst_mod.FORMAT
    assert manifest["runtime_version"] == "0.4.0"
    assert manifest["identity"] == pinned.identity
    names = inst_mod.required_files()
    assert sorted(manifest["files"]) == sorted(names)
    assert "kibotos/guest/agent.py" in names
    source = inst_mod.default_runtime_dir()
    for name, entry in manifest["files"].items():
        data = (pinned.path / name).read_bytes()
        assert data == (source / name).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert pinned.identity == inst_mod.identity_of(
        "0.4.0", {n: e["sha256"] for n, e in manifest["files"].items()})
    # a second start reuses it untouched; another release is another installation
    mtime = (pinned.path / "installation.json").stat().st_mtime_ns
    assert inst_mod.pin(root, N) == pinned
    assert (pinned.path / "installation.json").stat().st_mtime_ns == mtime
    other = inst_mod.pin(root, N1)
    assert other.identity != pinned.identity
    assert not list((root / "installations").glob(".tmp-*"))


def test_pin_rebuilds_a_damaged_current_installation(root: Path) -> None:
    pinned = inst_mod.pin(root, N)
    (pinned.path / "kibotos/guest/agent.py").write_text("tampered\n")
    with pytest.raises(FailedPrecondition, match="corrupted"):
        inst_mod.verify(root, pinned.identity)
    assert inst_mod.pin(root, N) == pinned
    inst_mod.verify(root, pinned.identity)


def test_pin_refuses_a_runtime_dir_without_the_required_files(tmp_path: Path) -> None:
    empty = tmp_path / "rt"
    empty.mkdir()
    with pytest.raises(FailedPrecondition, match=r"lacks kibotos/guest/agent\.py"):
        inst_mod.pin(tmp_path / "root", N, runtime_dir=empty)
    assert not (tmp_path / "root" / "installations").exists()


def test_a_backend_declares_its_runtime_executables(tmp_path: Path) -> None:
    class WithVmm(QemuVmm):
        RUNTIME_FILES = ("bin/kibovm",)

    runtime = tmp_path / "rt"
    shutil.copytree(inst_mod.default_runtime_dir() / "kibotos" / "guest",
                    runtime / "kibotos" / "guest")
    assert inst_mod.missing_files(runtime, inst_mod.required_files(WithVmm)) == \
        ["bin/kibovm"]
    (runtime / "bin").mkdir()
    (runtime / "bin" / "kibovm").write_bytes(b"\x7fELF vmm")
    pinned = inst_mod.pin(tmp_path / "root", N, runtime_dir=runtime, backend=WithVmm({}))
    assert (pinned.path / "bin" / "kibovm").read_bytes() == b"\x7fELF vmm"


@pytest.mark.parametrize(("runtime", "node", "ok"), [
    ("0.4.0", "0.4.0", True),        # the runtime this build pins
    ("0.4.0", "0.4.3", True),        # earlier on the same release line
    ("0.3.9", "0.4.0", True),        # the previous MINOR
    ("0.2.5", "0.4.0", False),       # two MINORs back
    ("0.4.5", "0.4.3", False),       # a later release
    ("1.3.0", "2.0.0", False),       # another MAJOR
    ("0.4.0a1", "0.4.0", False),     # a pre-release is a line of its own
    ("0.1.0.dev0", "0.1.0.dev0", True),
    ("unreleased", "0.4.0", False),
])
def test_runtime_version_range(runtime: str, node: str, ok: bool) -> None:
    problem = runtime_range_problem(runtime, BuildIdentity(release=node))
    assert (problem is None) == ok, problem
    if not ok:
        assert f"runtime version {runtime} is outside the range" in problem


def test_assess_keeps_a_complete_earlier_installation(root: Path) -> None:
    old = inst_mod.pin(root, N)
    new = inst_mod.pin(root, N1)
    verdict = inst_mod.assess(root, old.launch_fields(), new, N1)
    assert (verdict.ok, verdict.runtime_version, verdict.error) == (True, "0.4.0", None)
    assert inst_mod.assess(root, new.launch_fields(), new, N1).ok


def test_assess_refuses_out_of_range_corrupted_missing_and_unpinned(root: Path) -> None:
    old = inst_mod.pin(root, BuildIdentity(release="0.2.0"))
    current = BuildIdentity(release="0.4.0")
    new = inst_mod.pin(root, current)
    verdict = inst_mod.assess(root, old.launch_fields(), new, current)
    assert not verdict.ok
    assert verdict.error == inst_mod.UNAVAILABLE == "compatible runtime installation unavailable"
    assert "runtime version 0.2.0 is outside the range" in verdict.problem

    mid = inst_mod.pin(root, BuildIdentity(release="0.3.1"))
    assert inst_mod.assess(root, mid.launch_fields(), new, current).ok
    (mid.path / "kibotos/guest/agent.py").write_text("changed\n")
    verdict = inst_mod.assess(root, mid.launch_fields(), new, current)
    assert not verdict.ok
    assert "corrupted: the digest of kibotos/guest/agent.py" in verdict.problem
    (mid.path / "kibotos/guest/agent.py").unlink()
    assert "incomplete: kibotos/guest/agent.py is missing" in \
        inst_mod.assess(root, mid.launch_fields(), new, current).problem
    # a manifest edited to match a changed file describes another installation
    manifest = atomicfile.read_json(mid.path / "installation.json")
    manifest["runtime_version"] = "0.4.0"
    atomicfile.write_json(mid.path / "installation.json", manifest)
    assert "describes another installation" in \
        inst_mod.assess(root, mid.launch_fields(), new, current).problem
    shutil.rmtree(mid.path)
    assert "is missing" in inst_mod.assess(root, mid.launch_fields(), new, current).problem
    assert "pins no runtime installation" in \
        inst_mod.assess(root, None, new, current).problem
    assert "is not sha256-" in inst_mod.assess(
        root, {"identity": "../../etc"}, new, current).problem


def test_retain_logs_the_spec_record(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    old = inst_mod.pin(root, BuildIdentity(release="0.1.0"))
    current = BuildIdentity(release="0.4.0")
    new = inst_mod.pin(root, current)
    with caplog.at_level(logging.ERROR):
        verdict = inst_mod.retain(root, "inst-1", old.launch_fields(), new, current)
    assert not verdict.ok
    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith(inst_mod.NOT_RETAINED_EVENT))
    assert "instance=inst-1" in line
    assert old.identity in line
    assert "outside the range" in line


def test_prune_keeps_the_current_and_every_recorded_installation(root: Path) -> None:
    a = inst_mod.pin(root, BuildIdentity(release="0.3.0"))
    b = inst_mod.pin(root, BuildIdentity(release="0.3.1"))
    c = inst_mod.pin(root, N)
    failed = root / "runtime" / "instances" / "inst-9"
    failed.mkdir(parents=True)
    atomicfile.write_json(failed / "systemd.json", {"format": 1, "installation":
                                                    b.launch_fields()})
    atomicfile.write_json(failed / "instance.json", {"format": 1, "state": "FAILED"})
    leftover = root / "installations" / ".tmp-sha256-x-1234"
    leftover.mkdir()
    foreign = root / "installations" / "README"
    foreign.write_text("not ours\n")
    removed = inst_mod.prune(root, [c.identity])
    assert sorted(removed) == sorted([a.identity, leftover.name])
    assert b.path.is_dir()
    assert c.path.is_dir()
    assert foreign.exists()


async def test_launches_pin_the_current_installation_and_restarts_prune() -> None:
    base = short_dir()
    try:
        async with node_at(base, N) as node:
            await start(node, "inst-1", "ws-1")
            launch = json.loads((node.root / "runtime/instances/inst-1/systemd.json")
                                .read_text())
            old = launch["installation"]
            assert old["runtime_version"] == "0.4.0"
            assert old == node.manager.launcher.installation
            inst_mod.verify(node.root, old["identity"])
        async with node_at(base, N1) as node:
            # the Instance still runs on its installation: kept
            assert (node.root / "installations" / old["identity"]).is_dir()
            await start(node, "inst-2", "ws-2")
            launch = json.loads((node.root / "runtime/instances/inst-2/systemd.json")
                                .read_text())
            assert launch["installation"]["runtime_version"] == "0.4.1"
            assert launch["installation"]["identity"] != old["identity"]
            assert await node.command("instance.destroy", {"instance_id": "inst-1"}) == \
                {"destroyed": True}
        async with node_at(base, N1) as node:
            left = sorted(p.name for p in (node.root / "installations").iterdir())
            assert left == [launch["installation"]["identity"]]
    finally:
        await stop_units(base)
        shutil.rmtree(base, ignore_errors=True)


async def test_a_node_standing_for_a_release_reports_it_and_pins_its_runtime(
        tmp_path: Path) -> None:
    """`serve_node(build=…)`: the test build identity reaches ctrl in hello."""
    import trio
    from node_helpers import FakeCtrl, node_config, store_identity

    from kibotos.node.serve import serve_node
    from kibotos.node.session.control import SessionTiming

    timing = SessionTiming(ping_interval=0.5, silence_timeout=5.0, welcome_timeout=5.0,
                           slow_retry=1.0, backoff_initial=0.05, backoff_cap=0.2)
    with trio.fail_after(60):
        async with trio.open_nursery() as outer:
            fake = await outer.start(FakeCtrl().serve)
            config = node_config(tmp_path, ctrl_url=fake.ctrl_url)
            store_identity(config)
            for build in (N, N1, BuildIdentity(release="0.5.0.dev0")):
                async with trio.open_nursery() as nursery:
                    runtime = await nursery.start(
                        lambda task_status, b=build: serve_node(
                            config, timing=timing, build=b, task_status=task_status))
                    await runtime.session.status.wait_until(lambda s: s.connected)
                    nursery.cancel_scope.cancel()
            outer.cancel_scope.cancel()
    assert [c.hello["release_version"] for c in fake.conns] == \
        ["0.4.0", "0.4.1", "unreleased"]
    root = config.storage.root
    versions = sorted(json.loads((p / "installation.json").read_text())["runtime_version"]
                      for p in (root / "installations").iterdir())
    assert versions == ["0.5.0.dev0"]  # no Instance records the earlier ones: pruned
