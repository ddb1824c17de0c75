#!/usr/bin/env python3
"""Guest TCP through the egress process, beside the same traffic direct and from the
host (no guest), as ratios of one run.

    sudo .venv/bin/python bench/egress.py [--connects 100] [--mib 64] [--json]

Uses the network tests' world (`tests/network/netbed.py`: a stand-in host namespace,
"the internet" at 198.18.0.0/15, guests on their Instance's tap through a frame-copying
thread) and their egress helpers (`egressbed.py`: microsocks as the SOCKS5 server, the
egress process run by the node's supervisor as ``kibotos-egress``).  Three paths to the
test host 198.18.0.1:

    host     a socket in the host namespace (no guest, no slot table)
    veth     a socket in a namespace of its own, on a plain veth pair to the host
             namespace and routed from there (no tap, no guest, no nftables in it)
    direct   the guest through its slot table and the host's masquerade
    egress   the guest, redirected to the egress process, through microsocks
    socks    a socket in the host namespace through microsocks (no guest, no egress
             process: what the SOCKS5 server costs by itself)

For each: connect latency (connect, one byte echoed, close; median of `--connects`) and
throughput (`--mib` MiB sent to a sink that answers when it has all of it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "network")]

import trio  # noqa: E402
from egressbed import EgressNode, running, socks_server  # noqa: E402
from netbed import (  # noqa: E402
    SCOPE,
    Instance,
    World,
    bound,
    ip,
    link,
    network_config,
    new_netns,
    serve_tcp,
)

from kibotos.node.egress.listeners import EgressInstance  # noqa: E402
from kibotos.node.egress.supervisor import EgressSupervisor  # noqa: E402
from kibotos.node.network import host_table  # noqa: E402
from kibotos.node.network import netns as ns  # noqa: E402
from kibotos.node.network.policy import NetworkPolicy  # noqa: E402
from kibotos.node.network.records import NetworkRecords  # noqa: E402
from kibotos.protocol.commands.network import EgressRef  # noqa: E402
from kibotos.testing.fake_credentials import FakeCredentials  # noqa: E402

SINK_PORT = 9
CHUNK = 256 << 10
Factory = Callable[[], socket.socket]


def sink(conn: socket.socket) -> None:
    """Reads the announced number of bytes, then answers: no half-close, which many
    SOCKS5 servers (microsocks among them) do not pass on."""
    conn.settimeout(120)
    header = b""
    while len(header) < 8:
        header += conn.recv(8 - len(header))
    left = int.from_bytes(header, "big")
    while left > 0:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            return
        left -= len(chunk)
    conn.sendall(b"ok")


class SocksFromHost:
    """A socket of the host namespace whose `connect` goes through microsocks with a
    plain blocking SOCKS5 exchange: the SOCKS5 server's own cost, without the egress
    process."""

    def __init__(self, world: World) -> None:
        self.sock = ns.socket_in(world.host, socket.AF_INET, socket.SOCK_STREAM)

    def __enter__(self) -> SocksFromHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def settimeout(self, value: float) -> None:
        self.sock.settimeout(value)

    def connect(self, address: tuple[str, int]) -> None:
        s = self.sock
        s.connect(("198.18.1.2", 1080))
        s.sendall(b"\x05\x01\x02")
        assert s.recv(2) == b"\x05\x02"
        s.sendall(b"\x01\x05alice\x06s3cret")
        assert s.recv(2) == b"\x01\x00"
        s.sendall(b"\x05\x01\x00\x01" + socket.inet_aton(address[0])
                  + address[1].to_bytes(2, "big"))
        reply = b""
        while len(reply) < 10:
            reply += s.recv(10 - len(reply))
        assert reply[1] == 0, reply

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, size: int) -> bytes:
        return self.sock.recv(size)


def plain_veth(world: World) -> Path:
    """A namespace on a plain veth pair to the world's host namespace (10.250.0.0/30),
    routed to the internet through it: the cheapest way out of a namespace."""
    plain = new_netns("plain")
    world.namespaces.append(plain)  # removed with the world
    link(world.host, "plain0", plain, "eth0")
    ip(world.host, "addr", "add", "10.250.0.1/30", "dev", "plain0")
    ip(plain, "addr", "add", "10.250.0.2/30", "dev", "eth0")
    ip(plain, "route", "add", "default", "via", "10.250.0.1")
    return plain


def connect_once(make: Factory) -> float:
    start = time.perf_counter()
    with make() as sock:
        sock.settimeout(10)
        sock.connect(("198.18.0.1", 7))
        sock.sendall(b"x")
        if sock.recv(1) != b"x":
            raise RuntimeError("no echo")
    return time.perf_counter() - start


def throughput(make: Factory, mib: int) -> float:
    data = b"\0" * CHUNK
    with make() as sock:
        sock.settimeout(120)
        sock.connect(("198.18.0.1", SINK_PORT))
        start = time.perf_counter()
        count = mib * (1 << 20) // CHUNK
        sock.sendall((count * CHUNK).to_bytes(8, "big"))
        for _ in range(count):
            sock.sendall(data)
        answer = b""
        while len(answer) < 2 and (chunk := sock.recv(16)):
            answer += chunk
        if answer != b"ok":
            raise RuntimeError(f"the sink did not confirm (got {answer!r})")
        return mib / (time.perf_counter() - start)


async def handover(egress: EgressSupervisor, instance: EgressInstance, rounds: int
                   ) -> dict[str, float]:
    """An Instance given to the running egress process and taken back, `rounds` times
    (what an Instance with an Egress adds to its network's setup and teardown: the
    state pushed, its sockets opened in its namespace and handed over; then the state
    pushed without it): medians in ms."""
    serve, release = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        assert await egress.set_instance(instance)
        serve.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert await egress.remove_instance(instance.instance_id)
        release.append(time.perf_counter() - t0)
    return {"serve_ms": statistics.median(serve) * 1000,
            "release_ms": statistics.median(release) * 1000}


async def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Each path's connect latency and throughput, and `handover` under
    ``"handover"``."""
    world = World()
    records_dir = Path(tempfile.mkdtemp(prefix="kbe-bench-"))
    records = NetworkRecords(records_dir)
    direct = egress_instance = second = None
    try:
        host_table.prepare_host(network_config(), SCOPE, host_netns=world.host)
        serve_tcp(world.stopper, bound(world.inet, "198.18.0.1", SINK_PORT), sink)
        plain = plain_veth(world)
        direct = Instance(world, records, network_config(), "inst-direct")
        corp = EgressRef(name="corp", revision=1, address="198.18.1.2:1080",
                         authenticated=True)
        egress_instance = Instance(world, records, network_config(), "inst-egress",
                                   NetworkPolicy(egress=corp))
        second = Instance(world, records, network_config(), "inst-egress-2",
                          NetworkPolicy(egress=corp))
        with FakeCredentials("node-secret", {("corp", 1): ("alice", "s3cret")}) as ctrl, \
                socks_server(world):
            node = EgressNode(world, ctrl.url)
            try:
                async with running(node.egress()) as egress:
                    routed = EgressInstance.from_record(egress_instance.record)
                    assert routed is not None
                    assert await egress.set_instance(routed)
                    other = EgressInstance.from_record(second.record)
                    assert other is not None
                    results = {"handover": await handover(egress, other, args.connects)}
                    paths: dict[str, Factory] = {
                        "host": lambda: ns.socket_in(world.host, socket.AF_INET,
                                                     socket.SOCK_STREAM),
                        "veth": lambda: ns.socket_in(plain, socket.AF_INET,
                                                     socket.SOCK_STREAM),
                        "direct": lambda: direct.guest.socket(),
                        "egress": lambda: egress_instance.guest.socket(),
                        "socks": lambda: SocksFromHost(world),
                    }
                    for name, make in paths.items():
                        def run(make: Factory = make) -> dict[str, float]:
                            connect_once(make)  # warm up (ARP, conntrack, the tunnel)
                            times = [connect_once(make) for _ in range(args.connects)]
                            return {"connect_ms": statistics.median(times) * 1000,
                                    "mib_per_s": throughput(make, args.mib)}
                        print(f"measuring {name} ...", file=sys.stderr)
                        results[name] = await trio.to_thread.run_sync(run)
                    return results
            finally:
                await node.aclose()
    finally:
        for instance in (direct, egress_instance, second):
            if instance is not None:
                instance.close()
        world.close()
        shutil.rmtree(records_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connects", type=int, default=100)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = trio.run(measure, args)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    moves = results.pop("handover")
    host, direct, egress = results["host"], results["direct"], results["egress"]
    socks = results["socks"]
    print(f"an Instance given to the egress process {moves['serve_ms']:.2f} ms, taken back "
          f"{moves['release_ms']:.2f} ms (medians)")
    print(f"{'path':8} {'connect (median)':>18} {'throughput':>14}")
    for name, r in results.items():
        print(f"{name:8} {r['connect_ms']:15.2f} ms {r['mib_per_s']:9.1f} MiB/s")
    print(f"connect:    direct/host {direct['connect_ms'] / host['connect_ms']:.2f}x, "
          f"egress/direct {egress['connect_ms'] / direct['connect_ms']:.2f}x")
    print(f"throughput: direct/host {direct['mib_per_s'] / host['mib_per_s']:.2f}x, "
          f"egress/direct {egress['mib_per_s'] / direct['mib_per_s']:.2f}x")
    print(f"the SOCKS5 server alone (socks/host): connect "
          f"{socks['connect_ms'] / host['connect_ms']:.2f}x, throughput "
          f"{socks['mib_per_s'] / host['mib_per_s']:.2f}x")


if __name__ == "__main__":
    main()
