"""A node with ``[network]`` in a world of network namespaces the test makes
(tests/network/netbed.py: a stand-in host namespace with an uplink to "the internet",
198.18.0.0/15 with an HTTP, echo and DNS server, and a management network), for the
node's network tests with the light test VMM: its "VM" is a process in a namespace of
its own whose NIC is relayed to the Instance's tap (tests/testplugins/testvmm_guest.py).

The real host's network is never touched: the host ends of the veths, the host table
and the uplink are in the world's host namespace (``[testing] network_host_netns``);
only the Instance namespaces are under /run/netns, named by a scope of the test's own
(its socket directory).  Without root, nftables or /dev/net/tun the tests skip, and
fail under CI (``CI=true``), where .ci/run installs packaging/apt-test-deps.txt.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest

NETWORK_TESTS = Path(__file__).resolve().parents[1] / "network"
if str(NETWORK_TESTS) not in sys.path:
    sys.path.insert(0, str(NETWORK_TESTS))

import trio  # noqa: E402
from egressbed import (  # noqa: E402
    UPSTREAM_ANSWER,
    DirectCounter,
    egress_python,
    serve_upstream,
    socks_server,
)
from guest_fetch import FETCH_DEF  # noqa: E402
from instance_harness import Node, node_config, registries  # noqa: E402
from netbed import DNS_NAMES, LIFETIME, Stopper, World  # noqa: E402

from kibotos.config import NodeConfig  # noqa: E402
from kibotos.core import atomicfile  # noqa: E402
from kibotos.node.egress.supervisor import EgressTiming  # noqa: E402
from kibotos.node.egress.wiring import NodeEgress  # noqa: E402
from kibotos.node.instances.manager import VmInstanceManager  # noqa: E402
from kibotos.node.network import host_table, plumbing  # noqa: E402
from kibotos.node.network import netns as ns  # noqa: E402
from kibotos.node.network.names import node_scope  # noqa: E402

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
__all__ = ["DNS_NAMES", "UPSTREAM_ANSWER", "DirectCounter", "Stopper", "World",
           "serve_upstream", "socks_server"]

#: The node's [network] in the world (the pools are the world's own).
NETWORK = """
[network]
ipv4_pool = "10.200.0.0/24"
ipv6_pool = "fd00:6b69::/120"
management_cidrs = ["10.99.0.0/24"]
uplink = "up0"
public_egress = true
resolvers = ["198.18.0.1"]
"""


def require_network_tools() -> None:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [t for t in ("nft", "ip") if shutil.which(t, path=path) is None]
    if os.geteuid() != 0:
        missing.append("root (network namespaces)")
    if not os.path.exists("/dev/net/tun"):
        missing.append("/dev/net/tun")
    if ctypes.util.find_library("nftables") is None:
        missing.append("libnftables1")
    if missing:
        msg = f"the node network tests need {', '.join(missing)} (packaging/apt-test-deps.txt)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


@contextmanager
def world(lifetime: float = LIFETIME) -> Iterator[World]:
    """A `World` whose servers stop after `lifetime` seconds at the latest."""
    require_network_tools()
    bed = World(lifetime)
    try:
        yield bed
    finally:
        bed.close()


def socket_dir(base: Path) -> Path:
    return base / "sock"


def config_parts(base: Path, bed: World, **changes: str) -> dict[str, str]:
    """``extra`` and ``node_extra`` of `instance_harness.node_config` for a node with
    [network] in `bed`, named by a scope of its own; `changes` replace lines of
    `NETWORK` by key (``public_egress="false"``)."""
    lines = [f"{line.split(' = ')[0]} = {changes[line.split(' = ')[0]]}"
             if line.split(" = ")[0] in changes else line for line in NETWORK.splitlines()]
    network = "\n".join(lines) + "\n"
    return {"extra": network + f'[testing]\nnetwork_host_netns = "{bed.host}"\n',
            "node_extra": f'socket_dir = "{socket_dir(base)}"'}


def scope(base: Path) -> str:
    return node_scope(socket_dir(base))


def leftovers(base: Path, bed: World) -> list[str]:
    """Every network object a node over `base` could have left: its Instance
    namespaces, kibotos veths and pool addresses in the host namespace, network
    records."""
    found = [f"netns {n}" for n in plumbing.node_namespaces(scope(base))]
    found += [f"veth {v}" for v in plumbing.host_veths(bed.host)]
    with ns.netlink(bed.host) as ipr:
        found += [f"address {a.get_attr('IFA_ADDRESS')}" for a in ipr.get_addr()
                  if str(a.get_attr("IFA_ADDRESS")).startswith(("10.200.", "fd00:6b69:"))]
    records = base / "root" / "network"
    found += [f"record {p.name}" for p in records.glob("*")] if records.is_dir() else []
    return found


def host_table_present(base: Path, bed: World) -> bool:
    from kibotos.node.network import nft

    objects = nft.ruleset(bed.host, "read the host table")
    name = host_table.table_name(scope(base))
    return any(o.get("table", {}).get("name") == name for o in objects)


def launch_network(instance_dir: Path) -> dict[str, Any] | None:
    record = atomicfile.read_json(instance_dir / "systemd.json")
    value = record.get("network")
    return value if isinstance(value, dict) else None


#: Runs in the guest: ``fetch ADDRESS`` prints what the HTTP server at ADDRESS answers
#: (or ``failed: <errno>``); ``resolve NAME`` asks the nameserver of the guest's
#: resolv.conf (under the test VMM's guest root, ``$ROOT``) for NAME.
GUEST_TOOL = FETCH_DEF + r"""
import struct
def resolve(name, resolv):
    server = [l.split()[1] for l in open(resolv) if l.startswith("nameserver")][0]
    qname = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    q = struct.pack("!HHHHHH", 7, 0x100, 1, 0, 0, 0) + qname + struct.pack("!HH", 1, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    s.sendto(q, (server, 53))
    reply = s.recv(512)
    if struct.unpack("!H", reply[6:8])[0] == 0:
        return "none"
    return socket.inet_ntoa(reply[-4:])
kind, arg = sys.argv[1], sys.argv[2]
if kind == "fetch":  # an address: its HTTP server on port 80
    print(fetch(("[%s]:80" if ":" in arg else "%s:80") % arg))
else:
    print(resolve(arg, sys.argv[3]))
"""


class Bed:
    """A storage root for a node with [network] in a world of its own."""

    def __init__(self, base: Path, bed: World) -> None:
        self.base, self.world = base, bed
        self.parts = config_parts(base, bed)


@asynccontextmanager
async def network_bed(prefix: str) -> AsyncIterator[Bed]:
    """A `Bed`; at the end the units are stopped, the Instance namespaces a test left
    (an Instance left running keeps its own) removed and the world closed."""
    from adoption_harness import node_root

    with world() as w:
        async with node_root(prefix) as base:
            try:
                yield Bed(base, w)
            finally:
                for name in plumbing.node_namespaces(scope(base)):
                    ns.remove_netns(Path("/run/netns") / name)


async def guest(node: Node, instance_id: str, *args: str) -> str:
    """`GUEST_TOOL` run in the Instance's guest: its one line of output."""
    inst = node.manager.get(instance_id)
    assert inst is not None
    argv = [sys.executable, "-I", "-c", GUEST_TOOL, *args]
    if args[0] == "resolve":
        argv.append(str(inst.dir / "guestroot" / "etc" / "resolv.conf"))
    async with node.manager.launcher.guest(inst, timeout=30) as channel:
        status, out, err = await channel.run(argv)
    assert status.exit_code == 0, err
    return out.decode().strip()


async def create(node: Node, instance_id: str = "inst-n1",
                 network: dict[str, Any] | None = None, revision: int = 1) -> dict[str, Any]:
    """Create an Instance with a network (default policy); its RUNNING or FAILED frame."""
    args = node.create_args(instance_id, workspace_id=f"ws-{instance_id}",
                            network=network if network is not None else {},
                            network_revision=revision)
    assert await node.command("instance.create", args) == {"accepted": True}
    return await node.wait_state(instance_id, "RUNNING", "FAILED")


async def switch(node: Node, network: dict[str, Any], revision: int,
                 instance_id: str = "inst-n1") -> dict[str, Any]:
    return await node.command("instance.set_network", {
        "instance_id": instance_id, "network": network, "revision": revision})


# ---------------------------------------------------------------------------- egress

#: The node's identity as the fake of ctrl's credentials endpoint knows it.
NODE_CREDENTIAL = "node-secret"
#: Egress ``corp``'s revisions in the fake of ctrl: 1 as `socks_server` checks it, 2
#: with a password it refuses.
CORP_REVISIONS = {("corp", 1): ("alice", "s3cret"), ("corp", 2): ("alice", "wrong")}
#: A policy whose Resolver forwards to the upstream of `serve_upstream`.
THROUGH_UPSTREAM = {"resolver": {"name": "corp-dns", "revision": 1,
                                 "upstream": "upstream.test:5353"}}


def corp(revision: int = 1) -> dict[str, Any]:
    """Egress ``corp`` at the test internet's SOCKS5 server (`socks_server`)."""
    return {"name": "corp", "revision": revision, "address": "socks.test:1080",
            "authenticated": True}


def through_corp(revision: int = 1) -> dict[str, Any]:
    """All of the guest's TCP through Egress corp, nothing else leaves."""
    return {"egress": corp(revision), "public_egress": False}
#: A dead egress process is restarted after 5 s (not at once), so a test sees the
#: guest's connections fail in between without racing the restart.
EGRESS_TIMING = EgressTiming(watch_interval=0.2, restart_initial=5.0, restart_cap=5.0,
                             drain_deadline=120.0)


def attach_egress(node: Node, ctrl_url: str) -> NodeEgress:
    """`wire_egress` for a node of `instance_harness`."""
    return wire_egress(node.base, node.config, node.manager, ctrl_url)


def wire_egress(base: Path, config: NodeConfig, manager: VmInstanceManager,
                ctrl_url: str) -> NodeEgress:
    """The node's egress processes wired into `manager`'s network step as the node's
    serve wires them, before the manager runs (``run`` starts them, after the
    manager's), with an interpreter the egress account can run
    (tests/network/egressbed.py) and the credentials from the fake of ctrl at
    `ctrl_url`; `base` holds the node's socket directory."""
    os.chmod(base, 0o755)  # the egress account reaches its socket dir in it
    step = manager.launcher.network
    assert step is not None, "the node has no [network]"
    python, environment = egress_python()
    egress = NodeEgress.for_node(config, step, credential=lambda: NODE_CREDENTIAL,
                                 ctrl_url=ctrl_url, registries=registries(),
                                 python=python, environment=environment,
                                 timing=EGRESS_TIMING)
    step.egress = egress
    return egress


@asynccontextmanager
async def egress_node(bed: Bed, ctrl_url: str) -> AsyncIterator[tuple[Node, NodeEgress]]:
    """`adoption_harness.node_at` with its egress processes (`attach_egress`); they
    keep running at exit, like the VMMs (the next node adopts them; `network_bed`'s
    end stops every unit)."""
    from adoption_harness import node_at

    attached: list[NodeEgress] = []
    async with node_at(bed.base, adjust=lambda n: attached.append(attach_egress(n, ctrl_url)),
                       **bed.parts) as node, trio.open_nursery() as nursery:
        await nursery.start(attached[0].run)
        yield node, attached[0]
        nursery.cancel_scope.cancel()


async def egress_units(node: Path | NodeConfig) -> list[Any]:
    """The running egress units (`kibotos.backends.UnitInfo`) of a node: of its config,
    or of `instance_harness.node_config` over a base directory."""
    from kibotos.node.instances.setup import supervisor_options

    config = node if isinstance(node, NodeConfig) else node_config(node)
    sup = registries().supervisor.get("direct")(supervisor_options(config))
    return [u for u in await sup.list("kibotos-egress-") if u.active]
