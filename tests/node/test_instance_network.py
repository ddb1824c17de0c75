"""A Workspace's Instance gets its network, with the light test VMM and real namespaces,
veths, taps and nftables (node_network_harness): made before the VMM starts and
recorded in the launch record, the guest configured by its agent and reaching the test
internet by name through the deployment resolver and only what its policy allows, a
network switch in force at once, everything removed with the Instance; refused before
anything is written where the node cannot give it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
from adoption_harness import node_at
from instance_harness import running_node
from node_network_harness import (
    Bed,
    create,
    guest,
    host_table_present,
    launch_network,
    leftovers,
    network_bed,
    switch,
)

from kibotos.core.errors import FailedPrecondition
from kibotos.node.instances.contract import RUNNING
from kibotos.node.network import plumbing

pytestmark = pytest.mark.root
ID = "inst-n1"


@pytest.fixture
async def bed() -> AsyncIterator[Bed]:
    async with network_bed("kn-net-") as value:
        yield value


async def test_a_network_on_a_node_without_network_is_refused_before_anything() -> None:
    async with running_node() as node:
        args = node.create_args(ID, network={}, network_revision=1)
        with pytest.raises(FailedPrecondition) as info:
            await node.command("instance.create", args)
        assert info.value.details == {"reason": "no_network"}
        assert "has no [network]" in info.value.message
        assert node.manager.get(ID) is None
        assert not (node.root / "runtime" / "instances" / ID).exists()
        assert not (node.root / "network").exists()


async def test_the_guest_reaches_the_internet_by_name_and_only_what_its_policy_allows(
        bed: Bed) -> None:
    async with node_at(bed.base, **bed.parts) as node:
        assert host_table_present(bed.base, bed.world)
        frame = await create(node)
        assert frame["state"] == RUNNING, frame
        inst = node.manager.get(ID)
        assert inst is not None
        net = launch_network(inst.dir)
        assert net is not None
        assert net["table"] == "inet kibotos"
        assert net["tap"] == "tap0"
        assert net["addresses"]["v4"]["guest"] == "10.200.0.3"
        assert net["host_veth"] in plumbing.host_veths(bed.world.host)
        # the VMM runs in the Instance's namespace (the unit's NetworkNamespacePath)
        unit = await node.manager.launcher.supervisor.describe(inst.unit_name or "")
        assert unit is not None
        assert unit.netns_inode == os.stat(net["netns_path"]).st_ino

        # by name through the deployment resolver (the gateway, DNAT to 198.18.0.1)
        assert await guest(node, ID, "resolve", "files.test") == "198.18.1.1"
        assert await guest(node, ID, "fetch", "198.18.1.1") == "198.18.1.1"
        assert await guest(node, ID, "fetch", "2001:2::1") == "2001:2::1"
        # never the management network, the host's own addresses, the metadata service
        for address in ("10.99.0.2", "198.18.5.5", "198.18.0.2", "169.254.169.254"):
            assert (await guest(node, ID, "fetch", address)).startswith("failed"), address

        # a network switch, in force when it answers; a repeat changes nothing
        deny = {"deny_out": ["198.18.1.0/24"]}
        assert await switch(node, deny, 2) == {"network_revision": 2, "changed": True}
        assert (await guest(node, ID, "fetch", "198.18.1.1")).startswith("failed")
        assert await guest(node, ID, "fetch", "198.18.0.1") == "198.18.0.1"
        assert await switch(node, deny, 2) == {"network_revision": 2, "changed": False}
        with pytest.raises(FailedPrecondition, match="older than revision 2"):
            await switch(node, {}, 1)
        only = {"allow_out": ["198.18.1.1"], "deny_out": ["0.0.0.0/0", "::/0"]}
        await switch(node, only, 3)
        assert await guest(node, ID, "fetch", "198.18.1.1") == "198.18.1.1"
        for address in ("198.18.1.2", "198.18.0.1", "2001:2::1"):
            assert (await guest(node, ID, "fetch", address)).startswith("failed"), address

        assert await node.command("instance.destroy", {"instance_id": ID}) == \
            {"destroyed": True}
        assert leftovers(bed.base, bed.world) == []
        assert host_table_present(bed.base, bed.world)  # the node's, not the Instance's


async def test_a_stop_removes_the_network_and_a_new_instance_gets_the_slot(bed: Bed) -> None:
    async with node_at(bed.base, **bed.parts) as node:
        await create(node)
        stop = {"instance_id": ID, "force": False, "deadline_s": 10}
        assert set(await node.command("instance.stop", stop)) == {"confirmed_on_disk"}
        assert leftovers(bed.base, bed.world) == []
        frame = await create(node, "inst-n2")
        assert frame["state"] == RUNNING
        net = launch_network(node.root / "runtime" / "instances" / "inst-n2")
        assert net is not None
        assert net["addresses"]["index"] == 0  # the freed slot


@pytest.mark.parametrize(("network", "needle"), [
    ({"egress": {"name": "corp", "revision": 1, "address": "198.18.0.1:1080"}},
     "Egress corp"),
    ({"resolver": {"name": "dns", "revision": 1, "upstream": "198.18.0.1"}},
     "Resolver dns"),
])
async def test_a_policy_this_node_cannot_enforce_is_refused_before_anything(
        bed: Bed, network: dict[str, Any], needle: str) -> None:
    async with node_at(bed.base, **bed.parts) as node:
        with pytest.raises(FailedPrecondition, match=needle) as info:
            await node.command("instance.create",
                               node.create_args(ID, network=network, network_revision=1))
        assert info.value.details == {"reason": "network_policy"}
        assert node.manager.get(ID) is None
        assert leftovers(bed.base, bed.world) == []


async def test_a_switch_needs_a_running_instance_with_a_network(bed: Bed) -> None:
    async with node_at(bed.base, **bed.parts) as node:
        args = node.create_args(ID)  # no network
        assert await node.command("instance.create", args) == {"accepted": True}
        await node.wait_state(ID, RUNNING)
        with pytest.raises(FailedPrecondition, match="created without a network") as info:
            await switch(node, {}, 2)
        assert info.value.details == {"reason": "no_network"}
        inst = node.manager.get(ID)
        assert inst is not None
        assert launch_network(inst.dir) is None
        assert leftovers(bed.base, bed.world) == []
