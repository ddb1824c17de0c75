"""Shared pieces of the node tests: configs, prepared /proc trees, a stored identity, and
`FakeCtrl`, a small WebSocket server that plays ctrl's side of the control session."""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from kibotos.config import CtrlConfig, NodeConfig, load
from kibotos.core import atomicfile
from kibotos.node.instances.contract import Holdings, ManagerGauges, StateFeed
from kibotos.node.session.identity import NodeIdentity
from kibotos.node.storage.pools.marker import init_pool
from kibotos.tls import local_ctrl
from kibotos.tls.ca import ClusterCA

CREDENTIAL = "kid-test:secret-for-tests"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_proc(proc: Path, *, available_kb: int = 6_000_000, total_kb: int = 8_000_000,
               stat: tuple[int, ...] = (100, 0, 100, 800, 0, 0, 0, 0),
               cpu_pressure: str | None = "some avg10=1.00 avg60=2.50 avg300=0.00 total=1\n"
                                          "full avg10=0.00 avg60=0.50 avg300=0.00 total=1\n",
               memory_pressure: str | None = "some avg10=0.00 avg60=10.00 avg300=0.00 total=1\n"
                                             "full avg10=0.00 avg60=4.00 avg300=0.00 total=1\n",
               ) -> Path:
    """A /proc tree with the files the sampler reads (kB as the kernel writes them).

    ``self`` links to the real ``/proc/self``: the storage drivers read the mounts from
    ``<proc_root>/self/mounts``, and the pools of a test live on this host's real
    mounts (a test of a driver's verdict replaces the link with a prepared directory)."""
    proc.mkdir(parents=True, exist_ok=True)
    link_proc_self(proc)
    (proc / "meminfo").write_text(
        f"MemTotal:       {total_kb} kB\nMemFree:         100000 kB\n"
        f"MemAvailable:   {available_kb} kB\nBuffers:          1000 kB\n")
    (proc / "stat").write_text(
        "cpu  " + " ".join(str(x) for x in stat) + " 0 0\n"
        "cpu0 " + " ".join(str(x) for x in stat) + " 0 0\nintr 1 2 3\n")
    pressure = proc / "pressure"
    pressure.mkdir(exist_ok=True)
    for name, text in (("cpu", cpu_pressure), ("memory", memory_pressure)):
        if text is None:
            (pressure / name).unlink(missing_ok=True)
        else:
            (pressure / name).write_text(text)
    return proc


def link_proc_self(proc: Path) -> None:
    """``<proc>/self`` -> ``/proc/self`` unless the tree already has its own."""
    if not (proc / "self").is_symlink() and not (proc / "self").exists():
        (proc / "self").symlink_to("/proc/self")


def write_config(tmp_path: Path, *, ctrl_url: str | list[str] = "http://127.0.0.1:9",
                 node_id: str = "node-a", extra: str = "", pools: bool = True,
                 grant_file: Path | None = None, skew_file: Path | None = None,
                 ctrl_ca_file: Path | None = None) -> Path:
    """A node.toml under `tmp_path` with its storage root, one pool and a /proc tree;
    `ctrl_ca_file` verifies an https:// ctrl (`kibotos.tls.local_ctrl.ca_file`); a list
    `ctrl_url` names several replicas."""
    root = tmp_path / "root"
    pool = tmp_path / "pool-a"
    proc = tmp_path / "proc"
    if not proc.exists():
        write_proc(proc)
    text = f"""
[node]
id = "{node_id}"
ctrl_url = {json.dumps(ctrl_url)}
dataplane_listen = "127.0.0.1:7500"
socket_dir = "{tmp_path / 'run'}"
{f'enrollment_grant_file = "{grant_file}"' if grant_file else ""}
{f'ctrl_ca_file = "{ctrl_ca_file}"' if ctrl_ca_file else ""}
[storage]
root = "{root}"
"""
    if pools:
        # what an operator does before the node's first start (storage-pool init)
        init_pool("pool-a", pool, adopt=True)
        text += f"""
[[storage.pool]]
id = "pool-a"
path = "{pool}"
default = true
"""
    text += f"""
[resources]
cpu = 2.5
memory = "4G"
[host]
proc_root = "{proc}"
"""
    if skew_file:
        text += f'[testing]\nclock_skew_file = "{skew_file}"\n'
    text += extra
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def node_config(tmp_path: Path, **kwargs: Any) -> NodeConfig:
    return load(NodeConfig, write_config(tmp_path, **kwargs))


def store_identity(config: NodeConfig, credential: str = CREDENTIAL) -> NodeIdentity:
    """Write pki/identity.json as enrollment would, so a test can skip enrolling."""
    key = Ed25519PrivateKey.generate()
    identity = NodeIdentity(
        identity_id=credential.split(":")[0], credential=credential,
        node_id=config.node.id,
        private_key_pem=key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()).decode())
    pki = config.storage.root / "pki"
    pki.mkdir(parents=True, exist_ok=True)
    atomicfile.write_json(pki / "identity.json", identity.to_json(), mode=0o600)
    return identity


class RecordingInstances:
    """An Instance manager holding fixed figures, recording destroy_all calls."""

    def __init__(self, holdings: Holdings | None = None) -> None:
        self._holdings = holdings or Holdings()
        self.destroyed = 0
        self.feed = StateFeed()
        self.drain_requested: bool | None = None
        self._changed_cb: Callable[[], None] = lambda: None

    def set_change_callback(self, callback: Callable[[], None]) -> None:
        self._changed_cb = callback

    def set_holdings(self, holdings: Holdings) -> None:
        """What a real manager does when an Instance starts or ends."""
        self._holdings = holdings
        self._changed_cb()

    def holdings(self) -> Holdings:
        return self._holdings

    async def destroy_all(self) -> int:
        self.destroyed += 1
        count, self._holdings = self._holdings.instance_count, Holdings()
        return count

    def vm_usage(self) -> tuple[float | None, int | None]:
        return None, None

    def gauges(self) -> ManagerGauges:
        return ManagerGauges(drain_requested=self.drain_requested)

    def state_feed(self) -> StateFeed:
        return self.feed

    def command_handlers(self) -> dict[str, Any]:
        return {}

    def set_drain_requested(self, requested: bool) -> None:
        self.drain_requested = requested

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()


# ---------------------------------------------------------------------------- FakeCtrl


@dataclass
class Conn:
    """One accepted session, as ctrl sees it."""

    ws: WebSocketConnection
    hello: dict[str, Any]
    authorization: str | None
    number: int

    async def send(self, **msg: Any) -> None:
        await self.ws.send_message(json.dumps(msg))

    async def receive(self, *, skip: tuple[str, ...] = ("ping",)) -> dict[str, Any]:
        """The next frame from the node, answering pings on the way."""
        while True:
            msg = json.loads(await self.ws.get_message())
            if msg.get("type") == "ping":
                await self.send(type="pong")
            if msg.get("type") not in skip:
                return msg  # type: ignore[no-any-return]

    async def receive_type(self, kind: str) -> dict[str, Any]:
        while True:
            msg = await self.receive()
            if msg.get("type") == kind:
                return msg


Script = Callable[[Conn], Awaitable[None]]


async def welcome_and_hold(conn: Conn) -> None:
    """The usual ctrl: welcome, answer pings, until the socket closes."""
    await conn.send(type="welcome", session_id=f"ses-{conn.number}",
                    overcommit={"cpu": "1", "memory": "1", "serial": 1})
    while True:
        await conn.receive()


@dataclass
class FakeCtrl:
    """Plays ctrl on loopback.  Each connection runs `script`; connections, hellos and
    the frames the scripts saw are kept for the test to inspect."""

    script: Script = welcome_and_hold
    reject_status: int | None = None  # refuse the upgrade with this HTTP status
    port: int = 0
    conns: list[Conn] = field(default_factory=list)
    attempts: int = 0
    _changed: trio.Event = field(default_factory=trio.Event)

    @property
    def ctrl_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _touch(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_conns(self, n: int) -> Conn:
        while len(self.conns) < n:
            await self._changed.wait()
        return self.conns[n - 1]

    async def wait_attempts(self, n: int) -> None:
        while self.attempts < n:
            await self._changed.wait()

    async def _handler(self, request: WebSocketRequest) -> None:
        self.attempts += 1
        self._touch()
        if request.path != "/v1/node/session":
            await request.reject(404)
            return
        if self.reject_status is not None:
            await request.reject(self.reject_status, body=b'{"error":{"code":"unauthenticated",'
                                                         b'"message":"revoked"}}')
            return
        headers = {k.decode().lower(): v.decode() for k, v in request.headers}
        ws = await request.accept()
        try:
            hello = json.loads(await ws.get_message())
            conn = Conn(ws, hello, headers.get("authorization"), len(self.conns) + 1)
            self.conns.append(conn)
            self._touch()
            await self.script(conn)
        except ConnectionClosed:
            pass

    async def serve(self, *, task_status: trio.TaskStatus[FakeCtrl] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_websocket, self._handler, "127.0.0.1",
                                         self.port, None)
            self.port = server.port
            task_status.started(self)


@dataclass(frozen=True)
class CtrlEndpoint:
    """How a test reaches the ctrl of a ctrl.toml: its URL, the cluster CA file that
    verifies it, and a context made from that file."""

    url: str
    ca_file: Path | None
    tls: ssl.SSLContext


def ctrl_endpoint(ctrl_toml: Path) -> CtrlEndpoint:
    """The endpoint of the ctrl that `ctrl_toml` configures (its ``listen`` a fixed
    port).  Makes the cluster CA first, as ctrl's own start would, so clients can be
    built before ctrl runs; ctrl then loads the same one."""
    cfg = load(CtrlConfig, ctrl_toml)
    ClusterCA.load_or_create(cfg.ctrl.state_dir)
    return CtrlEndpoint(local_ctrl.ctrl_url(cfg, cfg.ctrl.listen), local_ctrl.ca_file(cfg),
                        local_ctrl.client_tls(cfg))
