"""configure's ``network``: the agent finds its interface by MAC and gives it the
addresses and default routes of the launch configuration over rtnetlink (no ``ip``
binary: the agent runs under Debian's plain ``python3``), idempotently.

The agent runs in a network namespace the test makes, with a tap standing for the
guest's NIC (a descriptor held open on it, so it has a carrier); ``ip`` reads the
result back (the test's own tool, not the code under test).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from guest_harness import AgentProcess, connected

from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.guest import Dns, GuestAddress, GuestChannel, GuestNetwork, LaunchConfig
from kibotos.node.network import netns as ns
from kibotos.node.network.tap import create_tap, open_tap

pytestmark = pytest.mark.root

MAC = "02:6b:69:00:00:07"
NETWORK = GuestNetwork(mac=MAC, addresses=[
    GuestAddress("ipv4", "10.200.0.3", 31, "10.200.0.2"),
    GuestAddress("ipv6", "fd00:6b69::3", 127, "fd00:6b69::2")])


def ip(netns: Path, *args: str) -> str:
    return subprocess.run(["ip", "-n", netns.name, *args], check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture
def guest_netns() -> Iterator[Path]:
    path = Path("/run/netns") / f"kbt-{uuid.uuid4().hex[:8]}-agent"
    ns.create_netns(path)
    create_tap(path, "eth7")
    ip(path, "link", "set", "eth7", "address", MAC)
    fd = open_tap(path, "eth7")  # the "VMM" side: the NIC has a carrier
    try:
        yield path
    finally:
        os.close(fd)
        ns.remove_netns(path)


@pytest.fixture
def agent(tmp_path: Path, guest_netns: Path) -> Iterator[AgentProcess]:
    proc = AgentProcess(tmp_path, prefix=("ip", "netns", "exec", guest_netns.name))
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log_text(), proc.log_text()


@pytest.fixture
async def guest(agent: AgentProcess) -> AsyncIterator[GuestChannel]:
    async with connected(agent) as channel:
        yield channel


async def test_the_interface_found_by_mac_gets_addresses_and_routes_once(
        guest: GuestChannel, agent: AgentProcess, guest_netns: Path) -> None:
    assert "configure.network" in (guest.hello.capabilities if guest.hello else ())
    config = LaunchConfig(network=NETWORK, dns=Dns(nameservers=["10.200.0.2"]))
    first = await guest.configure(config)
    assert set(first.actions) == {
        "brought lo up", "brought eth7 up", "added 10.200.0.3/31 to eth7",
        "added fd00:6b69::3/127 to eth7", "set the default route via 10.200.0.2 on eth7",
        "set the default route via fd00:6b69::2 on eth7", "wrote /etc/resolv.conf"}
    assert "inet 10.200.0.3/31" in ip(guest_netns, "-4", "addr", "show", "eth7")
    assert "inet6 fd00:6b69::3/127" in ip(guest_netns, "-6", "addr", "show", "eth7")
    assert "default via 10.200.0.2 dev eth7" in ip(guest_netns, "-4", "route")
    assert "default via fd00:6b69::2 dev eth7" in ip(guest_netns, "-6", "route")
    assert "UP" in ip(guest_netns, "link", "show", "lo")
    assert (agent.root / "etc" / "resolv.conf").read_text().endswith("nameserver 10.200.0.2\n")
    again = await guest.configure(config)
    assert (again.changed, again.actions) == (False, ())


async def test_addresses_not_configured_are_removed(guest: GuestChannel,
                                                    guest_netns: Path) -> None:
    ip(guest_netns, "addr", "add", "192.0.2.9/24", "dev", "eth7")
    result = await guest.configure(LaunchConfig(network=NETWORK))
    assert "removed 192.0.2.9/24 from eth7" in result.actions
    assert "192.0.2.9" not in ip(guest_netns, "-4", "addr", "show", "eth7")


async def test_a_mac_no_interface_has_is_refused(guest: GuestChannel) -> None:
    other = GuestNetwork(mac="02:6b:69:00:00:99", addresses=NETWORK.addresses)
    with pytest.raises(FailedPrecondition, match="no network interface has MAC "
                                                 "02:6b:69:00:00:99"):
        await guest.configure(LaunchConfig(network=other))


@pytest.mark.parametrize(("network", "needle"), [
    ({"mac": "02:6B:69:00:00:07", "addresses": []}, "is not a MAC"),
    ({"mac": MAC, "addresses": [{"family": "ipv4", "address": "10.200.0.3", "prefix": 31}]},
     "exactly family, address, prefix and gateway"),
    ({"mac": MAC, "addresses": [{"family": "ipv4", "address": "fd00::3", "prefix": 31,
                                 "gateway": "10.200.0.2"}]}, "is not a valid ipv4 address"),
    ({"mac": MAC, "addresses": [{"family": "ipv4", "address": "10.200.0.3", "prefix": 33,
                                 "gateway": "10.200.0.2"}]}, "is not a valid ipv4 address"),
    ({"mac": MAC, "addresses": [{"family": "ipv4", "address": "10.200.0.3", "prefix": 31,
                                 "gateway": "10.200.0.2"}] * 2}, "each at most once"),
    ({"mac": MAC, "route": "x"}, "takes mac and addresses"),
])
async def test_a_bad_network_is_refused_before_anything_changes(
        guest: GuestChannel, guest_netns: Path, network: dict, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        await guest._request("configure", {"config": {"network": network}})
    assert "10.200.0.3" not in ip(guest_netns, "addr")
