"""A small world of network namespaces for the network tests, all made by the test:

* ``host``: stands in for the node's host namespace (the real one is never touched);
  its uplink ``up0`` (198.18.0.2/24, 2001:2::2/64) leads to the internet, ``mg0``
  (10.99.0.1/24) to the management network, and it has one more address of its own,
  198.18.5.5 on its loopback;
* ``inet``: "the internet", 198.18.0.1 (also 198.18.1.1, 198.18.1.2, 2001:2::1 and the
  metadata address 169.254.169.254), with an HTTP server on port 80 of every address,
  a TCP echo server on port 7 and a DNS responder on 198.18.0.1:53;
* ``mgmt``: a management host, 10.99.0.2, with an HTTP server.

A `Guest` stands in for a VM: a namespace of its own with a tap (``gtap0``) holding the
guest's address, joined to the Instance's tap by a thread that copies frames between
the two tap descriptors, as QEMU copies them between its descriptor and the VM's NIC.

Every server and relay runs on a daemon thread that stops when the bed closes, and by
itself after `LIFETIME` seconds (a `World`'s own lifetime) at the latest.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import select
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from kibotos.network_config import NetworkSection
from kibotos.node.network import enforce, plumbing
from kibotos.node.network import netns as ns
from kibotos.node.network.policy import NetworkPolicy
from kibotos.node.network.records import NetworkRecords
from kibotos.node.network.tap import TAP_FLAGS, create_tap, open_tap

LIFETIME = 300.0
HOSTS_80 = ("198.18.0.1", "198.18.1.1", "198.18.1.2", "169.254.169.254", "2001:2::1")
#: The names the test DNS responder knows.
DNS_NAMES = {"files.test.": "198.18.1.1", "www.test.": "198.18.0.1",
             # the egress tests' SOCKS5 server and Resolver upstream (egressbed)
             "socks.test.": "198.18.1.2", "upstream.test.": "198.18.1.2"}
TEST_NETNS_DIR = Path("/run/netns")


def ip(netns: Path | None, *args: str) -> str:
    """``ip`` in a namespace: the test's own wiring, not the code under test."""
    argv = ["ip", *(["-n", netns.name] if netns is not None else []), *args]
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def new_netns(label: str) -> Path:
    path = TEST_NETNS_DIR / f"kbt-{uuid.uuid4().hex[:8]}-{label}"
    ns.create_netns(path)
    ip(path, "link", "set", "lo", "up")
    return path


def link(a: Path, a_name: str, b: Path, b_name: str) -> None:
    ip(a, "link", "add", a_name, "type", "veth", "peer", "name", b_name, "netns", b.name)
    ip(a, "link", "set", a_name, "up")
    ip(b, "link", "set", b_name, "up")


class Stopper:
    def __init__(self, lifetime: float = LIFETIME) -> None:
        self.event = threading.Event()
        self.deadline = time.monotonic() + lifetime
        self.threads: list[threading.Thread] = []

    @property
    def done(self) -> bool:
        return self.event.is_set() or time.monotonic() > self.deadline

    def spawn(self, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        self.threads.append(thread)

    def stop(self) -> None:
        self.event.set()
        for thread in self.threads:
            thread.join(timeout=5)


def serve_tcp(stopper: Stopper, sock: socket.socket,
              handle: Callable[[socket.socket], None]) -> None:
    sock.listen(16)
    sock.settimeout(0.2)

    def loop() -> None:
        with sock:
            while not stopper.done:
                try:
                    conn, _ = sock.accept()
                except TimeoutError:
                    continue
                conn.settimeout(5)
                stopper.spawn(lambda c=conn: _handle(c, handle))

    stopper.spawn(loop)


def _handle(conn: socket.socket, handle: Callable[[socket.socket], None]) -> None:
    with conn, contextlib.suppress(OSError):
        handle(conn)


def http_answer(text: str) -> Callable[[socket.socket], None]:
    def handle(conn: socket.socket) -> None:
        conn.recv(4096)
        body = text.encode()
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    return handle


def echo(conn: socket.socket) -> None:
    conn.settimeout(LIFETIME)
    while data := conn.recv(4096):
        conn.sendall(data)


def dns_answer(query: bytes) -> bytes:
    """A minimal DNS responder: A records of `DNS_NAMES`, NXDOMAIN for the rest."""
    (qid,) = struct.unpack("!H", query[:2])
    labels, i = [], 12
    while query[i]:
        labels.append(query[i + 1:i + 1 + query[i]].decode())
        i += 1 + query[i]
    question = query[12:i + 5]
    name = ".".join(labels) + "."
    address = DNS_NAMES.get(name)
    if address is None:
        return struct.pack("!HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question
    answer = (b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4)
              + ipaddress.IPv4Address(address).packed)
    return struct.pack("!HHHHHH", qid, 0x8180, 1, 1, 0, 0) + question + answer


def serve_dns(stopper: Stopper, sock: socket.socket) -> None:
    sock.settimeout(0.2)

    def loop() -> None:
        with sock:
            while not stopper.done:
                try:
                    query, peer = sock.recvfrom(512)
                except TimeoutError:
                    continue
                sock.sendto(dns_answer(query), peer)

    stopper.spawn(loop)


def dns_query(name: str, qid: int = 0x4242) -> bytes:
    qname = b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + qname + struct.pack("!HH", 1, 1)


def parse_a(reply: bytes) -> str | None:
    """The address of the first A record of `reply`, None for an empty answer."""
    if struct.unpack("!H", reply[6:8])[0] == 0:
        return None
    return str(ipaddress.IPv4Address(reply[-4:]))


def bound(netns: Path, address: str, port: int, kind: int = socket.SOCK_STREAM,
          ) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = ns.socket_in(netns, family, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    return sock


class World:
    """The host, internet and management namespaces with their servers, which stop
    after `lifetime` seconds at the latest."""

    def __init__(self, lifetime: float = LIFETIME) -> None:
        self.stopper = Stopper(lifetime)
        self.namespaces: list[Path] = []
        self.host = self._netns("host")
        self.inet = self._netns("inet")
        self.mgmt = self._netns("mgmt")
        link(self.host, "up0", self.inet, "inet0")
        link(self.host, "mg0", self.mgmt, "mgmt0")
        ip(self.host, "addr", "add", "198.18.0.2/24", "dev", "up0")
        ip(self.host, "-6", "addr", "add", "2001:2::2/64", "dev", "up0", "nodad")
        ip(self.host, "addr", "add", "10.99.0.1/24", "dev", "mg0")
        ip(self.host, "addr", "add", "198.18.5.5/32", "dev", "lo")
        ip(self.inet, "addr", "add", "198.18.0.1/24", "dev", "inet0")
        ip(self.inet, "-6", "addr", "add", "2001:2::1/64", "dev", "inet0", "nodad")
        for extra in ("198.18.1.1/32", "198.18.1.2/32", "169.254.169.254/32"):
            ip(self.inet, "addr", "add", extra, "dev", "lo")
        ip(self.mgmt, "addr", "add", "10.99.0.2/24", "dev", "mgmt0")
        # servers first, routes after (TESTBED: nothing here waits for a resolver)
        for address in HOSTS_80:
            serve_tcp(self.stopper, bound(self.inet, address, 80), http_answer(address))
        serve_tcp(self.stopper, bound(self.inet, "198.18.0.1", 7), echo)
        serve_dns(self.stopper, bound(self.inet, "198.18.0.1", 53, socket.SOCK_DGRAM))
        serve_tcp(self.stopper, bound(self.mgmt, "10.99.0.2", 80), http_answer("mgmt"))
        serve_tcp(self.stopper, bound(self.host, "0.0.0.0", 80), http_answer("host"))
        ip(self.host, "route", "add", "default", "via", "198.18.0.1")
        ip(self.host, "-6", "route", "add", "default", "via", "2001:2::1")
        ip(self.inet, "route", "add", "default", "via", "198.18.0.2")  # for 198.18.5.5
        ip(self.mgmt, "route", "add", "default", "via", "10.99.0.1")

    def _netns(self, label: str) -> Path:
        path = new_netns(label)
        self.namespaces.append(path)
        return path

    def close(self) -> None:
        self.stopper.stop()
        for path in self.namespaces:
            ns.remove_netns(path)


class Guest:
    """A VM's stand-in on the tap of the Instance namespace `instance_netns`."""

    def __init__(self, world: World, instance_netns: Path, tap: str, address: str,
                 gateway: str, prefix: int, v6: tuple[str, str] | None = None) -> None:
        self.stopper = Stopper()
        self.netns = new_netns("guest")
        create_tap(self.netns, "gtap0")
        ip(self.netns, "addr", "add", f"{address}/{prefix}", "dev", "gtap0")
        if v6 is not None:
            ip(self.netns, "-6", "addr", "add", f"{v6[0]}/127", "dev", "gtap0", "nodad")
        ip(self.netns, "link", "set", "gtap0", "up")
        ip(self.netns, "route", "add", "default", "via", gateway)
        if v6 is not None:
            ip(self.netns, "-6", "route", "add", "default", "via", v6[1])
        self.address = address
        self.gateway = gateway
        self._relay(open_tap(instance_netns, tap), open_tap(self.netns, "gtap0"))

    def _relay(self, a: int, b: int) -> None:
        def copy() -> None:
            try:
                while not self.stopper.done:
                    ready, _, _ = select.select([a, b], [], [], 0.2)
                    for fd in ready:
                        frame = os.read(fd, 65536 + 64)
                        os.write(b if fd == a else a, frame)
            finally:
                os.close(a)
                os.close(b)

        assert TAP_FLAGS  # both descriptors carry the same virtio-net header
        self.stopper.spawn(copy)

    def socket(self, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM,
               ) -> socket.socket:
        return ns.socket_in(self.netns, family, kind)

    def close(self) -> None:
        self.stopper.stop()
        ns.remove_netns(self.netns)


def fetch(sock_factory: Callable[[int], socket.socket], address: str, port: int = 80,
          timeout: float = 5.0) -> str:
    """The body an HTTP server at `address` answers, or ``failed: <errno name>`` when
    the connection fails (``EHOSTUNREACH`` at once when a table rejects it, ``timeout``
    when a packet is dropped)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with sock_factory(family) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect((address, port))
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
        except TimeoutError:
            return "failed: timeout"
        except OSError as exc:
            return f"failed: {errno.errorcode.get(exc.errno or 0, type(exc).__name__)}"
    return reply.split(b"\r\n\r\n", 1)[1].decode()


def resolve(guest: Guest, name: str, server: str, timeout: float = 5.0) -> str | None:
    with guest.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.sendto(dns_query(name), (server, 53))
        return parse_a(sock.recv(512))


# Per test run, so that two runs on one machine never share an Instance's names; the
# child processes a test starts (network_proc.py) inherit the run's scope.
SCOPE = os.environ.setdefault("KIBOTOS_TEST_NETWORK_SCOPE", f"{os.getpid() & 0xFFFFFFFF:08x}")


def network_config(**changes: object) -> NetworkSection:
    """The node's [network] in the `World`: pools of its own, the management network,
    the uplink ``up0``, the test internet's DNS responder as the deployment resolver."""
    values: dict[str, object] = {
        "ipv4_pool": "10.200.0.0/24", "ipv6_pool": "fd00:6b69::/120",
        "management_cidrs": ["10.99.0.0/24"], "uplink": "up0", "public_egress": True,
        "resolvers": ["198.18.0.1"]}
    values.update(changes)
    return NetworkSection.model_validate(values)


class Instance:
    """An Instance's network made by the code under test in the `World`'s host
    namespace, its first table written, and a `Guest` on its tap."""

    def __init__(self, world: World, records: NetworkRecords, config: NetworkSection,
                 instance_id: str, policy: NetworkPolicy | None = None) -> None:
        self.world, self.records, self.config = world, records, config
        uplink = enforce.uplink_addresses(config, world.host)
        record = records.allocate(instance_id, SCOPE, config, policy or NetworkPolicy(),
                                  uplink)
        self.netns = plumbing.setup(record, host_netns=world.host)
        self.record = enforce.write_table(records, record, config, uplink)
        v4, v6 = self.record.slot.v4, self.record.slot.v6
        self.guest = Guest(world, self.netns, self.record.names.tap, str(v4.guest),
                           str(v4.gateway), v4.prefix,
                           None if v6 is None else (str(v6.guest), str(v6.gateway)))

    def fetch(self, address: str, port: int = 80, timeout: float = 5.0) -> str:
        return fetch(self.guest.socket, address, port, timeout)

    def switch(self, policy: NetworkPolicy) -> None:
        uplink = enforce.uplink_addresses(self.config, self.world.host)
        self.record = enforce.switch_policy(self.records, self.record, policy, self.config,
                                            uplink)

    def close(self) -> None:
        self.guest.close()
        plumbing.teardown(self.record.names, host_netns=self.world.host)
        self.records.remove(self.record.instance_id)
