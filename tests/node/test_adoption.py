"""Adoption at node start with the light test VMM (`kibotos.node.instances.adoption`,
`kibotos.node.instances.adoption_background`): running Instances are taken over without a
guest restart and exec works at once; a guest that does not answer stays pending and
recovers; a guest that restarted is configured again; a refusing guest, an unmatched record, a unit
without a record, a pool that does not open; and the ownership check before a reclaim."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from adoption_harness import alive, node_at, node_root, start_instance
from instance_harness import DEADLINE, Node

from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition
from kibotos.node.instances.adoption import NOT_TAKEN_OVER, AdoptionRefused
from kibotos.node.instances.contract import FAILED, RUNNING


@pytest.fixture
async def base() -> AsyncIterator[Path]:
    async with node_root("ka-") as path:
        yield path


def launch_record(node: Node, instance_id: str) -> dict[str, Any]:
    return atomicfile.read_json(node.root / "runtime" / "instances" / instance_id /
                                "systemd.json")


def edit_json(path: Path, change: Any) -> None:
    value = atomicfile.read_json(path)
    change(value)
    atomicfile.write_json(path, value, mode=0o600)


async def refused_start(base: Path) -> AdoptionRefused:
    """Start a node over `base` that must refuse; the refusal (trio wraps it in groups)."""
    with pytest.raises(BaseExceptionGroup) as info:
        async with node_at(base):
            pass
    found: BaseException = info.value
    while isinstance(found, BaseExceptionGroup):
        assert len(found.exceptions) == 1, found
        found = found.exceptions[0]
    assert isinstance(found, AdoptionRefused), found
    return found


async def guest_frame(node: Node, instance_id: str, responding: bool) -> dict[str, Any]:
    """The first RUNNING frame whose guest says `responding`."""
    feed = node.manager.state_feed()
    seen = 0
    with trio.fail_after(DEADLINE):
        while True:
            seen, frames = await feed.after(seen)
            for f in frames:
                if f["instance_id"] == instance_id and f["state"] == RUNNING and \
                        (f.get("guest") or {}).get("responding") is responding:
                    return f


async def exec_echo(node: Node, instance_id: str) -> bytes:
    inst = node.manager.get(instance_id)
    async with node.manager.launcher.guest(inst) as channel:
        status, out, _ = await channel.run(["sh", "-c", "echo inside"])
    assert status.exit_code == 0
    return bytes(out)


async def test_restart_adopts_every_running_instance_without_a_guest_restart(
        base: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kibotos.node")
    ids = ["inst-1", "inst-2", "inst-3"]
    async with node_at(base) as node:
        for i in ids:
            await start_instance(node, i)
        before = {i: (node.manager.get(i).main_process, node.manager.get(i).guest["boot_id"])
                  for i in ids}
    caplog.clear()
    async with node_at(base) as node:
        for i in ids:  # adopted at start: RUNNING before any guest answered
            inst = node.manager.get(i)
            assert inst.state == RUNNING
            assert inst.main_process == before[i][0]
        assert await exec_echo(node, "inst-2") == b"inside\n"  # right after the start
        for i in ids:
            frame = await guest_frame(node, i, True)
            assert frame["guest"]["boot_id"] == before[i][1]
        await node.manager.takeover.wait_idle()
        assert all(launch_record(node, i)["guest"]["boot_id"] == before[i][1] for i in ids)
        units = await node.manager.launcher.supervisor.list("kibotos-vmm-")
        assert sorted((u.main_pid, u.start_time_ticks) for u in units) == \
            sorted(tuple(before[i][0]) for i in ids)
        assert node.manager.holdings().instance_count == 3
    text = caplog.text
    assert "instances reloaded count=3 adopt=3" in text
    assert "restarted while the node was away" not in text
    assert "instance guest sync pending" not in text


async def test_a_guest_that_does_not_answer_is_pending_until_it_does(
        base: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kibotos.node")
    async with node_at(base) as node:
        await start_instance(node, "inst-1")
        pid = node.manager.get("inst-1").main_process[0]
    os.kill(pid, signal.SIGSTOP)  # a stuck guest: the unit runs, the agent never answers
    try:
        async with node_at(base) as node:
            frame = await guest_frame(node, "inst-1", False)
            assert frame["state"] == RUNNING  # the Workspace stays AVAILABLE
            with trio.fail_after(DEADLINE):
                while "instance guest sync pending instance=inst-1 attempt=2" not in caplog.text:
                    await trio.sleep(0.1)
            assert node.manager.get("inst-1").state == RUNNING
            os.kill(pid, signal.SIGCONT)
            await guest_frame(node, "inst-1", True)
            await node.manager.takeover.wait_idle()
            assert "instance guest sync pending instance=inst-1 recovered=true" in caplog.text
            assert await exec_echo(node, "inst-1") == b"inside\n"
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_a_guest_that_restarted_while_away_is_configured_again(
        base: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kibotos.node")
    async with node_at(base) as node:
        await start_instance(node, "inst-1")
        real = node.manager.get("inst-1").guest["boot_id"]
    d = base / "root" / "runtime" / "instances" / "inst-1"
    # the node accepted another boot than the one that runs now
    edit_json(d / "systemd.json", lambda r: r["guest"].update(boot_id="boot-before"))
    edit_json(d / "instance.json", lambda r: r["guest"].update(boot_id="boot-before"))
    async with node_at(base) as node:
        frame = await guest_frame(node, "inst-1", True)
        assert frame["guest"]["boot_id"] == real
        await node.manager.takeover.wait_idle()
        assert launch_record(node, "inst-1")["guest"]["boot_id"] == real
        assert atomicfile.read_json(d / "instance.json")["guest"]["boot_id"] == real
    assert ("instance guest restarted while the node was away: reconfigured instance=inst-1 "
            "recorded_boot_id=boot-before") in caplog.text


async def test_a_refusing_guest_fails_and_reclaim_checks_ownership(base: Path) -> None:
    async with node_at(base) as node:
        await start_instance(node, "inst-1")
        main = node.manager.get("inst-1").main_process

    def narrow(node: Node) -> None:  # a build whose guest protocol range excludes it
        launcher = node.manager.launcher
        launcher.build = dataclasses.replace(launcher.build, guest_protocols=(99, 99))

    async with node_at(base, adjust=narrow) as node:
        frame = await node.wait_state("inst-1", FAILED)
        assert frame["reason"].startswith("recover instance process: stage "
                                          "CONFIGURING_GUEST: guest refused: guest protocol")
        assert alive(main[0])  # the VMM keeps running
    async with node_at(base) as node:  # reloaded FAILED: not taken over, its unit runs
        assert node.manager.get("inst-1").state == FAILED
        d = base / "root" / "runtime" / "instances" / "inst-1"
        edit_json(d / "instance.json", lambda r: r.update(main_process=[main[0] + 1, 1]))
        with pytest.raises(FailedPrecondition, match=NOT_TAKEN_OVER) as info:
            await node.command("instance.stop", {"instance_id": "inst-1", "force": True})
        assert "the node's Instance record binds process" in info.value.message
        assert alive(main[0])
        assert node.manager.get("inst-1").state == FAILED
        with pytest.raises(FailedPrecondition, match=NOT_TAKEN_OVER):
            await node.command("instance.destroy", {"instance_id": "inst-1"})
        edit_json(d / "instance.json", lambda r: r.update(main_process=list(main)))
        assert await node.command("instance.stop", {"instance_id": "inst-1",
                                                    "force": True}) == \
            {"confirmed_on_disk": False}
        assert not alive(main[0])
        assert await node.manager.launcher.supervisor.list("kibotos-vmm-") == []


async def test_a_record_that_does_not_match_its_unit_refuses_the_start(base: Path) -> None:
    async with node_at(base) as node:
        await start_instance(node, "inst-1")
        main = node.manager.get("inst-1").main_process
    d = base / "root" / "runtime" / "instances" / "inst-1"
    edit_json(d / "systemd.json", lambda r: r["unit"].update(invocation_id="0" * 32))
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.suffix == ".json"}
    refusal = await refused_start(base)
    assert refusal.message.startswith("node startup refused")
    assert "invocation_id recorded '" + "0" * 32 in refusal.message
    assert alive(main[0])
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.suffix == ".json"} == before


async def test_a_running_unit_without_a_record_refuses_the_start(base: Path) -> None:
    async with node_at(base) as node:
        await start_instance(node, "inst-1")
    d = base / "root" / "runtime" / "instances" / "inst-1"
    (d / "instance.json").rename(base / "instance.json.away")
    assert "runs with no Instance record" in (await refused_start(base)).message
    (base / "instance.json.away").rename(d / "instance.json")
    async with node_at(base) as node:
        assert node.manager.get("inst-1").state == RUNNING


async def test_a_pool_that_does_not_open_fails_the_takeover(
        base: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with node_at(base) as node:
        await start_instance(node, "inst-1")
        await start_instance(node, "inst-2")
        mains = [node.manager.get(i).main_process for i in ("inst-1", "inst-2")]

    def shorten(node: Node) -> None:
        node.manager.takeover.gate.wait = 1.0

    async with node_at(base, pool_unavailable=lambda pool: "marker missing (test)",
                       adjust=shorten) as node:
        for i in ("inst-1", "inst-2"):
            reason = (await node.wait_state(i, FAILED))["reason"]
            assert reason.startswith("recover instance process: stage "
                                     "PREPARING_RETAINED_LAYER: storage pool not opened")
            assert "storage pool is unavailable: pool pool-a: marker missing" in reason
        assert all(alive(m[0]) for m in mains)
    assert caplog.text.count("storage pool not opened for takeover pool=pool-a") == 1
    assert caplog.text.count("instance takeover failed") == 2


async def test_a_pool_that_opens_within_the_wait_is_taken_over(base: Path) -> None:
    async with node_at(base) as node:
        await start_instance(node, "inst-1")
    opened_at = trio.current_time() + 1.5

    def unavailable(pool: str) -> str | None:
        return None if trio.current_time() >= opened_at else "not mounted yet"

    async with node_at(base, pool_unavailable=unavailable) as node:
        await guest_frame(node, "inst-1", True)
        await node.manager.takeover.wait_idle()
        assert node.manager.get("inst-1").state == RUNNING
        assert json.loads((node.pool / "retained-layers" / "holders" /
                           "ws-inst-1.json").read_text())["node_id"] == "node-a"


async def test_an_earlier_installation_that_cannot_be_kept_fails_the_takeover(
        base: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with node_at(base) as node:
        await start_instance(node, "inst-1")
        main = node.manager.get("inst-1").main_process
    d = base / "root" / "runtime" / "instances" / "inst-1"
    missing = "sha256-" + "b" * 64  # an earlier installation whose directory is gone
    edit_json(d / "systemd.json", lambda r: r["installation"].update(identity=missing))
    async with node_at(base) as node:
        reason = (await node.wait_state("inst-1", FAILED))["reason"]
        assert reason.startswith("recover instance process: stage "
                                 "RETAINING_RUNTIME_INSTALLATION: compatible runtime "
                                 "installation unavailable")
        assert alive(main[0])  # the VMM keeps running
        assert f"earlier runtime installation cannot be retained instance=inst-1 " \
            f"installation={missing}" in caplog.text
        # reclaimed with force once the node checked it owns the unit
        assert await node.command("instance.stop", {"instance_id": "inst-1",
                                                    "force": True}) == \
            {"confirmed_on_disk": False}
        assert not alive(main[0])
