"""What the egress tests add to `netbed`'s world: a count of the packets that reached
the test internet's services directly from the host namespace (proof that nothing went
around the egress), a SOCKS5 server (Debian's microsocks, a real server that checks
username and password) and a DNS upstream in the internet namespace.

Every server stops by itself: microsocks runs under ``timeout``, the DNS upstream on a
`netbed.Stopper` thread.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from netbed import LIFETIME, Stopper, World, bound, dns_query, ip

from kibotos.node.network import netns as ns

#: Where the test internet's SOCKS5 server and DNS upstream listen (inet namespace).
SOCKS_ADDRESS = "198.18.1.2"
SOCKS_PORT = 1080
UPSTREAM_ADDRESS = "198.18.1.2"
UPSTREAM_PORT = 5353
#: What the upstream answers for every A query, so an answer shows where it came from.
UPSTREAM_ANSWER = "198.18.7.7"


def nft(netns: Path, script: str) -> str:
    return subprocess.run(["ip", "netns", "exec", netns.name, "nft", *script.split()],
                          check=True, capture_output=True, text=True).stdout


class DirectCounter:
    """Counts TCP SYNs and UDP datagrams that arrive at the internet namespace over its
    link from the host (``inet0``) for the test host's services (ports 80, 7 and 53).
    The SOCKS5 server's own connections to them stay inside the namespace (loopback),
    so every counted packet is one that left the host directly."""

    def __init__(self, world: World) -> None:
        self.netns = world.inet
        script = ("add table inet kbtprobe\n"
                  "add chain inet kbtprobe input { type filter hook input priority -10; }\n"
                  'add rule inet kbtprobe input iifname "inet0" tcp flags syn tcp dport '
                  "{ 80, 7 } counter\n"
                  'add rule inet kbtprobe input iifname "inet0" udp dport { 53, 5353 } '
                  "counter\n")
        subprocess.run(["ip", "netns", "exec", self.netns.name, "nft", "-f", "-"],
                       input=script, check=True, capture_output=True, text=True)

    def packets(self) -> int:
        out = subprocess.run(["ip", "netns", "exec", self.netns.name, "nft", "-j", "list",
                              "table", "inet", "kbtprobe"], check=True, capture_output=True,
                             text=True).stdout
        total = 0
        for item in json.loads(out)["nftables"]:
            for expr in item.get("rule", {}).get("expr", []):
                if "counter" in expr:
                    total += int(expr["counter"]["packets"])
        return total


class Socks5Server:
    """microsocks in the internet namespace, with a username and password."""

    def __init__(self, world: World, username: str, password: str) -> None:
        self.world, self.username, self.password = world, username, password
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("microsocks")
        assert binary is not None, "microsocks (packaging/apt-test-deps.txt)"
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.world.inet.name, "timeout", str(int(LIFETIME)),
             binary, "-i", SOCKS_ADDRESS, "-p", str(SOCKS_PORT), "-u", self.username,
             "-P", self.password], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until it listens
            with contextlib.suppress(OSError), \
                    ns.socket_in(self.world.inet, socket.AF_INET, socket.SOCK_STREAM) as s:
                s.settimeout(1)
                s.connect((SOCKS_ADDRESS, SOCKS_PORT))
                return
            time.sleep(0.05)
        raise AssertionError("microsocks did not start listening")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@contextlib.contextmanager
def socks_server(world: World, username: str = "alice", password: str = "s3cret"
                 ) -> Iterator[Socks5Server]:
    server = Socks5Server(world, username, password)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def upstream_answer(query: bytes) -> bytes:
    """`UPSTREAM_ANSWER` for any A question (name echoed back), as the upstream."""
    (qid,) = struct.unpack("!H", query[:2])
    i = 12
    while query[i]:
        i += 1 + query[i]
    question = query[12:i + 5]
    answer = (b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4)
              + socket.inet_aton(UPSTREAM_ANSWER))
    return struct.pack("!HHHHHH", qid, 0x8180, 1, 1, 0, 0) + question + answer


def serve_upstream(world: World, stopper: Stopper) -> None:
    """The Resolver's upstream on `UPSTREAM_ADDRESS`:`UPSTREAM_PORT`, UDP and TCP."""
    udp = bound(world.inet, UPSTREAM_ADDRESS, UPSTREAM_PORT, socket.SOCK_DGRAM)
    udp.settimeout(0.2)
    tcp = bound(world.inet, UPSTREAM_ADDRESS, UPSTREAM_PORT)
    tcp.listen(16)
    tcp.settimeout(0.2)

    def udp_loop() -> None:
        with udp:
            while not stopper.done:
                try:
                    query, peer = udp.recvfrom(512)
                except TimeoutError:
                    continue
                udp.sendto(upstream_answer(query), peer)

    def tcp_loop() -> None:
        with tcp:
            while not stopper.done:
                try:
                    conn, _ = tcp.accept()
                except TimeoutError:
                    continue
                with conn, contextlib.suppress(OSError):
                    conn.settimeout(5)
                    (length,) = struct.unpack("!H", _exactly(conn, 2))
                    reply = upstream_answer(_exactly(conn, length))
                    conn.sendall(struct.pack("!H", len(reply)) + reply)

    stopper.spawn(udp_loop)
    stopper.spawn(tcp_loop)


def _exactly(conn: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = conn.recv(count - len(data))
        if not chunk:
            raise OSError("closed")
        data += chunk
    return data


def tcp_query(sock: socket.socket, name: str) -> bytes:
    query = dns_query(name)
    sock.sendall(struct.pack("!H", len(query)) + query)
    (length,) = struct.unpack("!H", _exactly(sock, 2))
    return _exactly(sock, length)


__all__ = ["DirectCounter", "Socks5Server", "ip", "nft", "serve_upstream", "socks_server",
           "tcp_query"]
