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
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio
from netbed import LIFETIME, Stopper, World, bound, dns_query, ip

from kibotos.backends import Supervisor, UnitInfo
from kibotos.node.egress.credentials import CredentialClient, CredentialStore
from kibotos.node.egress.supervisor import EgressSupervisor, EgressTiming
from kibotos.node.network import netns as ns
from kibotos.plugins import load_plugins
from kibotos.testing.accounts import ensure_system_user

#: Where the test internet's SOCKS5 server and DNS upstream listen (inet namespace).
SOCKS_ADDRESS = "198.18.1.2"
SOCKS_PORT = 1080
UPSTREAM_ADDRESS = "198.18.1.2"
UPSTREAM_PORT = 5353
#: What the upstream answers for every A query, so an answer shows where it came from.
UPSTREAM_ANSWER = "198.18.7.7"


class DirectCounter:
    """Counts what arrives at the internet namespace over its link from the host
    (``inet0``): TCP SYNs for the test host's services (ports 80 and 7: ``"tcp"``) and
    packets for the Resolver upstream (port 5353, UDP and TCP: ``"upstream"``).  The
    SOCKS5 server's own connections to them stay inside the namespace (loopback), so
    every counted packet is one that left the host directly."""

    def __init__(self, world: World) -> None:
        self.netns = world.inet
        script = ("add table inet kbtprobe\n"
                  "add chain inet kbtprobe input { type filter hook input priority -10; }\n"
                  'add rule inet kbtprobe input iifname "inet0" tcp flags syn tcp dport '
                  '{ 80, 7 } counter comment "tcp"\n'
                  'add rule inet kbtprobe input iifname "inet0" meta l4proto { tcp, udp } '
                  'th dport 5353 counter comment "upstream"\n')
        subprocess.run(["ip", "netns", "exec", self.netns.name, "nft", "-f", "-"],
                       input=script, check=True, capture_output=True, text=True)

    def packets(self, kind: str = "tcp") -> int:
        out = subprocess.run(["ip", "netns", "exec", self.netns.name, "nft", "-j", "list",
                              "table", "inet", "kbtprobe"], check=True, capture_output=True,
                             text=True).stdout
        total = 0
        for item in json.loads(out)["nftables"]:
            rule = item.get("rule", {})
            if rule.get("comment") != kind:
                continue
            for expr in rule.get("expr", []):
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
        if binary is None:
            msg = "the egress tests need microsocks (packaging/apt-test-deps.txt)"
            if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
                pytest.fail(msg)
            pytest.skip(msg)
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


# ---------------------------------------------------------------------------- the node


def egress_python() -> tuple[str, dict[str, str]]:
    """An interpreter the egress account can run, and the environment it needs.  This
    test's own may live where the account cannot go (a pyenv under /root); then the
    system's Python of the same version runs the checkout with the venv's packages on
    ``PYTHONPATH`` (the Debian package's venv is on the system Python already)."""
    account = ensure_system_user()
    try:
        probe = subprocess.run([sys.executable, "-c", "import trio, kibotos"],
                               user=account.pw_uid, group=account.pw_gid, extra_groups=[],
                               capture_output=True, cwd="/", check=False)
        if probe.returncode == 0:
            return sys.executable, {}
    except PermissionError:
        pass
    system = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    assert Path(system).exists(), f"no interpreter the egress account can run ({system})"
    site = next(p for p in sys.path if p.endswith("site-packages"))
    return system, {"PYTHONPATH": f"{REPO}:{site}"}


REPO = str(Path(__file__).resolve().parents[2])
FAST = EgressTiming(watch_interval=0.2, restart_initial=0.3, restart_cap=1.0,
                    confirm_timeout=5.0, drain_deadline=120.0)


class EgressNode:
    """What a node keeps across its restarts: its directories, in a short path under
    /tmp that the egress account may traverse (its socket directory is in it)."""

    def __init__(self, world: World, ctrl_url: str | None = None,
                 node_credential: str = "node-secret") -> None:
        self.world = world
        self.base = Path(tempfile.mkdtemp(prefix="kbe-", dir="/tmp"))
        os.chmod(self.base, 0o755)
        self.storage_root = self.base / "storage"
        self.storage_root.mkdir(mode=0o700)
        self.ctrl_url, self.node_credential = ctrl_url, node_credential
        self.python, self.environment = egress_python()

    @property
    def socket_dir(self) -> Path:
        return self.base / "run"

    @property
    def credentials_dir(self) -> Path:
        return self.storage_root / "state" / "egress-credentials"

    def supervisor(self) -> Supervisor:
        cls = load_plugins().supervisor.get("direct")
        return cls({"state_dir": str(self.base / "units")})  # type: ignore[no-any-return]

    def egress(self, timing: EgressTiming = FAST) -> EgressSupervisor:
        client = None if self.ctrl_url is None else \
            CredentialClient(self.ctrl_url, self.node_credential)
        return EgressSupervisor(
            socket_dir=self.socket_dir, storage_root=self.storage_root,
            supervisor=self.supervisor(), resolvers=["198.18.0.1"],
            credentials=CredentialStore(self.storage_root / "state", client),
            host_netns=self.world.host, python=self.python, environment=self.environment,
            timing=timing)

    async def units(self) -> list[UnitInfo]:
        return [u for u in await self.supervisor().list("kibotos-egress-") if u.active]

    async def aclose(self) -> None:
        sup = self.supervisor()
        for info in await sup.list(""):
            await sup.stop(info.name, timeout=5)
        shutil.rmtree(self.base, ignore_errors=True)

    def close(self) -> None:
        """`aclose` for a fixture outside trio."""
        trio.run(self.aclose)


@contextlib.asynccontextmanager
async def running(egress: EgressSupervisor) -> AsyncIterator[EgressSupervisor]:
    """`egress.run` in a nursery, cancelled on the way out (the node stops; the egress
    processes do not)."""
    async with trio.open_nursery() as nursery:
        await nursery.start(egress.run)
        yield egress
        nursery.cancel_scope.cancel()


def process_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


__all__ = ["DirectCounter", "Socks5Server", "ip", "serve_upstream", "socks_server",
           "tcp_query"]
