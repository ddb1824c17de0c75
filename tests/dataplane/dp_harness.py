"""Shared pieces of the data-plane tests: a real guest agent on a unix socket (the
stand-in for a VM's ``agent-dp.sock``), a data plane in this process or as a real
``kibotos dataplane serve`` process, the node's side of the control socket, and ctrl's
signing key.

Every wait is a poll under a generous deadline; nothing asserts how long anything took.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import trio

from kibotos.backends import Supervisor
from kibotos.core.credentials import SigningKey
from kibotos.core.errors import Unavailable
from kibotos.dataplane.clients.client import ExecClient, Output, Started, open_exec
from kibotos.dataplane.endpoints.exec_session import ExecRequest
from kibotos.dataplane.process.control import control_call, control_path
from kibotos.dataplane.process.serve import DataplaneServer, DataplaneSettings, serve_dataplane
from kibotos.dataplane.process.state import Target, state_message
from kibotos.guest import AGENT_PATH, ExitStatus
from kibotos.node.dataplane.supervisor import DataplaneSupervisor, DataplaneTiming
from kibotos.plugins import load_plugins

GUEST_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
TIMEOUT = 60
NODE_ID = "node-a"
INSTANCE_ID = "inst-1"
WORKSPACE_ID = "ws-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Agent:
    """The real guest agent (``kibotos/guest/agent.py --socket``) under the guest's
    Python, its /etc files under a scratch root."""

    def __init__(self, tmp_path: Path, name: str = "agent-dp.sock", *,
                 prefix: tuple[str, ...] = ()) -> None:
        self.socket = tmp_path / name
        self.root = tmp_path / "guest-root"
        self.root.mkdir(exist_ok=True)
        self.log = tmp_path / f"{name}.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*prefix, GUEST_PYTHON, str(AGENT_PATH), "--socket", str(self.socket),
                 "--root", str(self.root), "--log-level", "DEBUG"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def running_agent(tmp_path: Path, name: str = "agent-dp.sock", *,
                  prefix: tuple[str, ...] = ()) -> Iterator[Agent]:
    """The agent for the block; `prefix` wraps it (``setpriv`` for an unprivileged one)."""
    agent = Agent(tmp_path, name, prefix=prefix)
    try:
        yield agent
    finally:
        agent.stop()
    assert "Traceback" not in agent.log_text(), agent.log_text()


@dataclass
class Plane:
    """A data plane under test and what a caller needs to reach it."""

    socket_dir: Path
    generation: int
    key: SigningKey
    listen: str
    server: DataplaneServer | None = None
    targets: list[Target] = field(default_factory=list)
    #: What clients verify a TLS data plane with (None: it serves plain HTTP).
    client_tls: ssl.SSLContext | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.client_tls else 'http'}://{self.listen}"

    @property
    def control(self) -> Path:
        return control_path(self.socket_dir)

    async def hand_state(self, *targets: Target, node_id: str = NODE_ID,
                         key: SigningKey | None = None) -> dict[str, object]:
        self.targets = list(targets)
        return await control_call(self.control, state_message(
            self.generation, node_id, (key or self.key).public_key, targets), timeout=TIMEOUT)

    def credential(self, *, instance_id: str = INSTANCE_ID, workspace_id: str = WORKSPACE_ID,
                   node_id: str = NODE_ID, operations: tuple[str, ...] = ("exec",),
                   now: float | None = None, key: SigningKey | None = None) -> str:
        return (key or self.key).issue(workspace_id=workspace_id, instance_id=instance_id,
                                       node_id=node_id, operations=operations, now=now)[0]


def target(agent: Agent, instance_id: str = INSTANCE_ID,
           workspace_id: str | None = WORKSPACE_ID) -> Target:
    return Target(instance_id, agent.socket, workspace_id)


@contextlib.asynccontextmanager
async def in_process_plane(tmp_path: Path, *, generation: int = 1,
                           drain_timeout: float = 10.0,
                           client_tls: ssl.SSLContext | None = None) -> AsyncIterator[Plane]:
    """`serve_dataplane` in this trio run (no signal handling), on a free port; with
    `client_tls` it serves TLS (with no certificate until the test sends one)."""
    socket_dir = tmp_path / "run"
    settings = DataplaneSettings(listen="127.0.0.1:0", socket_dir=socket_dir,
                                 generation=generation, drain_timeout=drain_timeout,
                                 handle_signals=False, tls=client_tls is not None)
    async with trio.open_nursery() as nursery:
        server: DataplaneServer = await nursery.start(serve_dataplane, settings)
        yield Plane(socket_dir, generation, SigningKey.generate(), server.listen_address,
                    server, client_tls=client_tls)
        nursery.cancel_scope.cancel()


class PlaneProcess:
    """``kibotos dataplane serve`` as a real process (for signals and the CLI)."""

    def __init__(self, tmp_path: Path, *, generation: int = 1, drain_timeout: float = 10.0,
                 listen: str | None = None, tls: bool = False) -> None:
        self.listen = listen or f"127.0.0.1:{free_port()}"
        self.socket_dir = tmp_path / "run"
        self.log = tmp_path / f"dataplane-{generation}.log"
        self.generation = generation
        argv = [sys.executable, "-m", "kibotos.cli.main", "dataplane", "serve",
                "--listen", self.listen, "--socket-dir", str(self.socket_dir),
                "--generation", str(generation), "--drain-timeout", str(drain_timeout),
                *([] if tls else ["--plain"])]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def plane(self, key: SigningKey, client_tls: ssl.SSLContext | None = None) -> Plane:
        return Plane(self.socket_dir, self.generation, key, self.listen,
                     client_tls=client_tls)

    async def wait_serving(self) -> dict[str, object]:
        """Until the control socket answers ``status``."""
        path = control_path(self.socket_dir)
        with trio.fail_after(TIMEOUT):
            while True:
                assert self.proc.poll() is None, self.log_text()
                try:
                    return await control_call(path, {"type": "status"}, timeout=5)
                except Exception:
                    await trio.sleep(0.05)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Result:
    status: ExitStatus
    stdout: bytes
    stderr: bytes
    pid: int | None


async def run_exec(plane: Plane, argv: list[str] | tuple[str, ...], *, stdin: bytes = b"",
                   credential: str | None = None, tty: bool = False,
                   env: dict[str, str] | None = None, cwd: str | None = None,
                   during: Callable[[ExecClient, bytes], object] | None = None,
                   user: str | None = None) -> Result:
    """Run `argv` through the data plane to the end; `during(client, stdout_so_far)` is
    awaited after the start and after every output chunk (to send signals or input at
    the right moment).  stdin is fed concurrently with reading: a process that echoes
    its input would otherwise block on output nobody reads, and stop reading input."""
    out, err = bytearray(), bytearray()

    async def feed(ex: ExecClient) -> None:
        # The process may exit (and the server close) before all input is sent.
        with contextlib.suppress(Unavailable):
            if stdin:
                await ex.send_stdin(stdin)
            if not tty:
                await ex.close_stdin()

    with trio.fail_after(TIMEOUT):
        async with open_exec(plane.url, credential or plane.credential(),
                             ExecRequest(tuple(argv), env or {}, cwd, tty, user=user),
                             ssl_context=plane.client_tls) as ex:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(feed, ex)
                async for event in ex.events():
                    if isinstance(event, Output):
                        (out if event.stream == 1 else err).extend(event.data)
                    if during is not None and isinstance(event, Output | Started):
                        await during(ex, bytes(out))  # type: ignore[misc]
            assert ex.exit is not None
            return Result(ex.exit, bytes(out), bytes(err), ex.pid)


@contextlib.asynccontextmanager
async def running(dp: DataplaneSupervisor) -> AsyncIterator[DataplaneSupervisor]:
    """The node process's part: `run` until the block ends (the unit stays)."""
    async with trio.open_nursery() as nursery:
        with trio.fail_after(TIMEOUT):
            await nursery.start(dp.run)
        yield dp
        nursery.cancel_scope.cancel()


FAST = DataplaneTiming(watch_interval=0.2, restart_initial=0.2, restart_cap=1.0,
                       metrics_interval=0.5)


@dataclass
class Node:
    """What a node keeps across its restarts: its directories and config."""

    base: Path
    listen: str
    key: SigningKey

    @property
    def socket_dir(self) -> Path:
        return self.base / "run"

    @property
    def state_dir(self) -> Path:
        return self.base / "state"

    def supervisor(self) -> Supervisor:
        cls = load_plugins().supervisor.get("direct")
        return cls({"state_dir": str(self.base / "units")})  # type: ignore[no-any-return]

    def dataplane(self, *, listen: str | None = None, timing: DataplaneTiming = FAST,
                  tls: bool = False) -> DataplaneSupervisor:
        """Plain HTTP unless `tls` (these tests are about the processes; TLS has its own
        in test_dataplane_tls and test_dataplane_cert_renewal)."""
        return DataplaneSupervisor(node_id="node-a", listen=listen or self.listen,
                                   socket_dir=self.socket_dir, state_dir=self.state_dir,
                                   supervisor=self.supervisor(), timing=timing, tls=tls)

    def plane(self, dp: DataplaneSupervisor) -> Plane:
        assert dp.generation is not None
        return Plane(self.socket_dir, dp.generation, self.key, dp.listen)


async def hand_over(node: Node, dp: DataplaneSupervisor, agent: Agent) -> None:
    """ctrl's key and the Instance, as a node hands them over."""
    assert await dp.set_public_key(node.key.public_key)
    assert await dp.set_target(target(agent))
