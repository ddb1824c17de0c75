"""The network at node start, with the light test VMM and real namespaces and nftables
(node_network_harness): the slot table regenerated from the recorded policy with this
version and replaced in one transaction, a guest's open TCP connection kept, the
rewrite logged with the Instance, namespace and differences; the spec's four refusal
cases, each produced by hand, end with the Instance FAILED, its network isolated and
its VMM still running; a network switch a crash cut in half is reported by
check-maintenance and finished by the next start."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from adoption_harness import build_node, node_at, run_child
from instance_harness import Node, node_config, registries
from node_network_harness import Bed, config_parts, create, guest, leftovers, network_bed

from kibotos.core import atomicfile
from kibotos.node.checks import maintenance_check
from kibotos.node.instances.contract import FAILED, RUNNING
from kibotos.node.network.enforce import REWRITTEN_LOG

pytestmark = [pytest.mark.root, pytest.mark.slow]
ID = "inst-n1"

#: Holds one TCP connection to the test internet's echo server across the restart:
#: "connected" once it is open, then, when the trigger file appears, one more round
#: trip on the same connection ("after: ok" or "after: failed …").
HOLDER = r"""
import os, socket, sys, time
out, trigger = sys.argv[1], sys.argv[2]
s = socket.create_connection(("198.18.0.1", 7), timeout=5)
s.sendall(b"before"); assert s.recv(16) == b"before"
open(out, "w").write("connected")
deadline = time.monotonic() + 120
while not os.path.exists(trigger) and time.monotonic() < deadline:
    time.sleep(0.05)
try:
    s.settimeout(5); s.sendall(b"after")
    result = "after: ok" if s.recv(16) == b"after" else "after: wrong echo"
except OSError as exc:
    result = f"after: failed {exc}"
open(out, "w").write(result)
"""


@pytest.fixture
async def bed() -> AsyncIterator[Bed]:
    async with network_bed("kn-adn-") as value:
        yield value


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


async def wait_for_text(path: Path, start: str) -> str:
    with trio.fail_after(60):
        while not (text := await trio.to_thread.run_sync(_text, path)).startswith(start):
            await trio.sleep(0.05)
    return text


def netns_of(node: Node) -> str:
    value = atomicfile.read_json(node.root / "network" / f"{ID}.json")
    return str(value["names"]["netns"])


def in_netns(netns: str, *argv: str) -> str:
    return subprocess.run(["ip", "netns", "exec", netns, *argv], check=True,
                          capture_output=True, text=True).stdout


async def test_a_restart_rewrites_the_table_logs_it_and_keeps_the_connection(
        bed: Bed, caplog: pytest.LogCaptureFixture) -> None:
    out, trigger = bed.base / "holder.out", bed.base / "holder.go"
    async with node_at(bed.base, **bed.parts) as node:
        assert (await create(node))["state"] == RUNNING
        inst = node.manager.get(ID)
        assert inst is not None
        async with node.manager.launcher.guest(inst, timeout=30) as channel:
            await channel.exec([sys.executable, "-I", "-c", HOLDER, str(out), str(trigger)],
                               on_detach="keep", stdin=False)
        await wait_for_text(out, "connected")
        netns = netns_of(node)
    # the next node has another resolver list: a difference the rewrite applies
    parts = config_parts(bed.base, bed.world, resolvers='["198.18.0.1", "198.18.1.1"]')
    caplog.set_level(logging.INFO, logger="kibotos.node")
    async with node_at(bed.base, **parts) as node:
        await node.manager.takeover.wait_idle()
        inst = node.manager.get(ID)
        assert inst is not None
        assert inst.state == RUNNING
        lines = [r.getMessage() for r in caplog.records if REWRITTEN_LOG in r.getMessage()]
        assert len(lines) == 1, lines
        assert f"instance={ID}" in lines[0]
        assert f"netns={netns}" in lines[0]
        assert "set resolver4: {198.18.0.1/32} becomes {198.18.0.1/32, 198.18.1.1/32}" \
            in lines[0], lines[0]
        trigger.touch()
        assert await wait_for_text(out, "after:") == "after: ok"
        assert await guest(node, ID, "fetch", "198.18.1.1") == "198.18.1.1"
        assert await node.command("instance.destroy", {"instance_id": ID}) == \
            {"destroyed": True}
    assert leftovers(bed.base, bed.world) == []


def foreign_table(netns: str) -> None:
    in_netns(netns, "nft", "add", "table", "ip", "handmade")


def rule_by_hand(netns: str) -> None:
    in_netns(netns, "nft", "insert", "rule", "inet", "kibotos", "forward", "ip", "daddr",
             "10.99.0.2", "accept")


@pytest.mark.parametrize(("case", "needle"), [
    ("foreign table", "not the node's"),
    ("rule by hand", "added by hand"),
    ("management_cidrs changed", "address set management4"),
    ("public egress gone", "no longer provides"),
    ("namespace bind removed", "is missing"),
])
async def test_each_refusal_case_isolates_the_network_and_fails_the_instance(
        bed: Bed, case: str, needle: str) -> None:
    async with node_at(bed.base, **bed.parts) as node:
        assert (await create(node))["state"] == RUNNING
        netns = netns_of(node)
        inst = node.manager.get(ID)
        assert inst is not None
        unit = inst.unit_name
    parts = bed.parts
    if case == "foreign table":
        foreign_table(netns)
    elif case == "rule by hand":
        rule_by_hand(netns)
    elif case == "management_cidrs changed":
        parts = config_parts(bed.base, bed.world,
                             management_cidrs='["10.99.0.0/24", "10.98.0.0/24"]')
    elif case == "public egress gone":
        parts = config_parts(bed.base, bed.world, public_egress="false")
    else:  # `ip netns del`: the VMM keeps the namespace alive, the name is gone
        await trio.run_process(["ip", "netns", "del", netns])
    async with node_at(bed.base, **parts) as node:
        frame = await node.wait_state(ID, FAILED)
        assert "stage ATTACHING_NETWORK: network isolated" in frame["reason"], frame
        assert needle in frame["reason"], frame
        info = await node.manager.launcher.supervisor.describe(unit or "")
        assert info is not None
        assert info.active  # the VMM keeps running
        assert (await guest(node, ID, "fetch", "198.18.0.1")).startswith("failed")
        # isolated through the name, or through the VMM's own namespace without one
        enter = ["nsenter", f"--net=/proc/{info.main_pid}/ns/net"]
        links = await trio.run_process([*enter, "ip", "link", "show", "veth0"],
                                       capture_stdout=True)
        assert b"state DOWN" in links.stdout
        # reclaimed like any FAILED Instance: everything goes
        assert await node.command("instance.destroy", {"instance_id": ID}) == \
            {"destroyed": True}
    assert leftovers(bed.base, bed.world) == []


async def test_a_switch_cut_in_half_is_reported_and_the_next_start_finishes_it(
        bed: Bed) -> None:
    node = build_node(bed.base, **bed.parts)  # for its create arguments only
    create_args = node.create_args(ID, workspace_id="ws-n1", network={}, network_revision=1)
    deny = {"deny_out": ["198.18.1.0/24"]}
    steps = [("instance.create", create_args), ("wait", ID),
             ("instance.set_network", {"instance_id": ID, "network": deny, "revision": 2})]
    await run_child(bed.base, steps, "node.network.switch.after-pending", **bed.parts)
    record = atomicfile.read_json(bed.base / "root" / "network" / f"{ID}.json")
    assert record["pending_revision"] == 2
    config = node_config(bed.base, **bed.parts)  # the node stays stopped
    report = await maintenance_check.run(config, "upgrade", registries=registries())
    assert report.exit_code == 13, report.render()
    assert any(f"instance {ID}: a network switch is half done" in line
               for line in report.of("blocked")), report.render()
    async with node_at(bed.base, **bed.parts) as node:
        await node.manager.takeover.wait_idle()
        inst = node.manager.get(ID)
        assert inst is not None
        assert inst.state == RUNNING
        record = atomicfile.read_json(bed.base / "root" / "network" / f"{ID}.json")
        assert (record["pending_policy"], record["revision"]) == (None, 2)
        assert (await guest(node, ID, "fetch", "198.18.1.1")).startswith("failed")
        assert await guest(node, ID, "fetch", "198.18.0.1") == "198.18.0.1"
        assert await node.command("instance.destroy", {"instance_id": ID}) == \
            {"destroyed": True}
    assert leftovers(bed.base, bed.world) == []


async def test_check_maintenance_reports_network_leftovers(bed: Bed) -> None:
    async with node_at(bed.base, **bed.parts) as node:
        assert (await create(node))["state"] == RUNNING
    config = node_config(bed.base, **bed.parts)
    report = await maintenance_check.run(config, "upgrade", registries=registries())
    assert report.exit_code == 0, report.render()
    # the Instance's directory gone by hand: its record and namespace have no owner
    netns = atomicfile.read_json(bed.base / "root" / "network" / f"{ID}.json")["names"]["netns"]
    async with node_at(bed.base, **bed.parts) as node:
        assert await node.command("instance.destroy", {"instance_id": ID}) == \
            {"destroyed": True}
    atomicfile.write_json(bed.base / "root" / "network" / "inst-gone.json", {"format": 1})
    await trio.run_process(["ip", "netns", "add", f"{netns.rsplit('-', 2)[0]}-inst-gone"])
    report = await maintenance_check.run(config, "upgrade", registries=registries())
    blocked = report.of("blocked")
    assert any("network record" in line and "inst-gone.json belongs to no Instance" in line
               for line in blocked), report.render()
    assert any("network namespace" in line and "inst-gone belongs to no Instance" in line
               for line in blocked), report.render()
