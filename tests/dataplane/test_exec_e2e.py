"""``kibo workspace exec`` end to end: a real ctrl, a real node (`serve_node` with its
data plane, the ``testvmm`` backend and the ``direct`` supervisor), a Workspace created
through the API, and the exec command as a process.

What it proves beyond the unit tests: ctrl's key reaches the data plane through the
welcome, the node reports its data-plane address, the target is handed over before the
Instance is reported RUNNING, and the CLI maps the process's end to its exit status.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from dp_harness import TIMEOUT, free_port

from kibotos.config import CtrlConfig, NodeConfig, parse
from kibotos.ctrl.live.context import utcnow
from kibotos.ctrl.model import enrollment
from kibotos.ctrl.serve import open_store, serve_ctrl
from kibotos.ctrl.store.models import Template
from kibotos.node.serve import NodeRuntime, serve_node
from kibotos.node.session.control import SessionTiming
from kibotos.plugins import EXTRA_MODULES_ENV, load_plugins
from kibotos.testing.waiting import wait_until
from kibotos.tls import local_ctrl
from kibotos.tls.local_ctrl import client_tls, ctrl_url

TESTPLUGINS = Path(__file__).resolve().parent.parent / "testplugins"
KIBO = [sys.executable, "-c", "from kibotos.cli.main import kibo_main; kibo_main()"]
TIMING = SessionTiming(ping_interval=0.5, backoff_initial=0.05, backoff_cap=0.5)

pytestmark = pytest.mark.slow


def blob(artifacts: Path, data: bytes) -> str:
    import hashlib

    digest = hashlib.sha256(data).hexdigest()
    (artifacts / "sha256").mkdir(parents=True, exist_ok=True)
    (artifacts / "sha256" / digest).write_bytes(data)
    return f"sha256:{digest}"


@dataclass
class Cluster:
    base: Path
    url: str
    http: httpx.AsyncClient
    operator: dict[str, str]
    kibo_config: Path
    node: NodeRuntime

    async def call(self, method: str, path: str, **kwargs: Any) -> Any:
        resp = await self.http.request(method, path, headers=self.operator, **kwargs)
        assert resp.status_code == 200, resp.text
        return resp.json()["result"]

    async def exec(self, workspace: str, *args: str, stdin: bytes = b""
                   ) -> trio.CompletedProcess[bytes]:
        """``kibo workspace exec`` as its own process."""
        return await self.kibo("exec", workspace, *args, stdin=stdin)

    async def kibo(self, command: str, *args: str, stdin: bytes = b""
                   ) -> trio.CompletedProcess[bytes]:
        """``kibo workspace COMMAND ARGS…`` as its own process."""
        argv = [*KIBO, "workspace", command, "--config", str(self.kibo_config), *args]
        with trio.fail_after(TIMEOUT):
            return await trio.run_process(argv, stdin=stdin, capture_stdout=True,
                                          capture_stderr=True, check=False)


async def wait_state(c: Cluster, workspace: str, state: str) -> dict[str, Any]:
    with trio.fail_after(TIMEOUT * 2):
        while True:
            ws = await c.call("GET", f"/v1/workspaces/{workspace}", params={"wait_s": 5})
            if ws["state"] == state:
                return dict(ws)
            assert ws["state"] != "FAILED", ws


async def stop_units(config: NodeConfig) -> None:
    from kibotos.node.instances.setup import supervisor_options

    regs = load_plugins(test_modules=["kibotos_testvmm"])
    sup = regs.supervisor.get("direct")(supervisor_options(config))
    for info in await sup.list(""):
        await sup.stop(info.name, timeout=5)


@asynccontextmanager
async def cluster(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    monkeypatch.setenv(EXTRA_MODULES_ENV, "kibotos_testvmm")
    monkeypatch.syspath_prepend(str(TESTPLUGINS))
    base = Path(tempfile.mkdtemp(prefix="kex-", dir="/tmp"))  # short socket paths
    ctrl_config = CtrlConfig.model_validate({"ctrl": {
        "listen": "127.0.0.1:0", "state_dir": str(base / "ctrl"), "reconcile_interval": "1h"},
        "testing": {"pool_capacity": "1T"}})
    artifacts = base / "artifacts"
    digests = [blob(artifacts, data) for data in (b"image\n", b"kernel\n", b"initramfs\n")]
    node_config: NodeConfig | None = None
    try:
        async with trio.open_nursery() as nursery:
            address = await nursery.start(partial(serve_ctrl, ctrl_config,
                                                  handle_signals=False))
            url = ctrl_url(ctrl_config, address)  # https: a certificate from the cluster CA
            ca_file = local_ctrl.ca_file(ctrl_config)
            assert ca_file is not None
            store = await open_store(ctrl_config)
            try:
                now = datetime.now(UTC)
                await store.write(lambda s: s.add(Template(
                    name="tiny", image_digest=digests[0], image_size=6,
                    kernel_digest=digests[1], initramfs_digest=digests[2], source=None,
                    created_at=now, updated_at=now, revision=1)))
                grant = await store.write(partial(
                    enrollment.create_grant, kind="operator", node_id=None, name="op",
                    expires_in_s=None, created_by=None, now=utcnow()))
            finally:
                store.close()
            async with httpx.AsyncClient(base_url=url, timeout=60,
                                         verify=client_tls(ctrl_config)) as http:
                resp = await http.post("/v1/enrollment/exchange", json={
                    "token": grant["token"], "public_key": _public_key()})
                exchanged = resp.json()["result"]
                credential = exchanged["credential"]
                operator = {"Authorization": f"Bearer {credential}"}
                kibo = base / "kibo.toml"
                # As `kibo enroll` writes it: the cluster CA of the exchange answer is
                # what the data plane's certificate is verified against.
                kibo.write_text(f'ctrl_url = "{url}"\ncredential = "{credential}"\n'
                                f'ctrl_ca = {json.dumps(ca_file.read_text())}\n'
                                f'cluster_ca = {json.dumps(exchanged["cluster_ca"])}\n')
                node_grant = (await http.post("/v1/enrollment/grants", headers=operator,
                                              json={"kind": "node", "node_id": "node-a"}
                                              )).json()["result"]["token"]
                (base / "grant").write_text(node_grant + "\n")
                node_config = _node_config(base, url, artifacts, ca_file)
                runtime: NodeRuntime = await nursery.start(partial(
                    serve_node, node_config, dataplane=True, timing=TIMING))
                with trio.fail_after(TIMEOUT):
                    await runtime.session.status.wait_until(lambda s: s.connected)
                yield Cluster(base, url, http, operator, kibo, runtime)
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            if node_config is not None:
                await stop_units(node_config)
        shutil.rmtree(base, ignore_errors=True)


def _public_key() -> str:
    import base64

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    raw = Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def _node_config(base: Path, url: str, artifacts: Path, ca_file: Path) -> NodeConfig:
    import tomllib

    from kibotos.dev.layout import prepare_proc_root
    from kibotos.node.storage.pools.marker import init_pool

    init_pool("pool-a", base / "pool")
    (base / "proc").mkdir()

    prepare_proc_root(base / "proc")
    text = f"""
[node]
id = "node-a"
ctrl_url = "{url}"
ctrl_ca_file = "{ca_file}"
enrollment_grant_file = "{base / 'grant'}"
dataplane_listen = "127.0.0.1:{free_port()}"
socket_dir = "{base / 'run'}"
[storage]
root = "{base / 'root'}"
[[storage.pool]]
id = "pool-a"
path = "{base / 'pool'}"
default = true
[resources]
cpu = 4
memory = "8G"
[host]
proc_root = "{base / 'proc'}"
[vmm]
backend = "testvmm"
artifact_dirs = ["{artifacts}"]
"""
    return parse(NodeConfig, tomllib.loads(text), "test node.toml")


async def test_exec_through_ctrl_node_and_data_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    async with cluster(monkeypatch) as c:
        with trio.fail_after(TIMEOUT):
            while not (node := await c.call("GET", "/v1/nodes/node-a"))["placement"][
                    "eligible"]:
                await trio.sleep(0.1)
        # The node serves TLS with a certificate from ctrl (kibo verifies it against the
        # cluster CA `kibo enroll` saved): it reports an https:// address.
        assert node["dataplane_address"] == f"https://{c.node.config.node.dataplane_listen}"
        created = await c.call("POST", "/v1/workspaces", json={
            "template": "tiny", "memory_bytes": 256 << 20, "layer_size_bytes": 64 << 20})
        workspace = created["workspace_id"]
        ws = await wait_state(c, workspace, "AVAILABLE")
        assert c.node.dataplane is not None
        dp = c.node.dataplane.dataplane
        # The target was handed over before the node reported the Instance RUNNING.
        assert dp.confirmed
        assert set(dp.targets) == {ws["instance_id"]}
        assert dp.targets[ws["instance_id"]].workspace_id == workspace

        done = await c.exec(workspace, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
        assert done.returncode == 7, done.stderr
        assert (done.stdout, done.stderr) == (b"out\n", b"err\n")
        done = await c.exec(workspace, "--env", "GREETING=hello", "--cwd", "/tmp", "--",
                            "sh", "-c", 'cat; echo "$GREETING from $(pwd)"',
                            stdin=b"piped in\n")
        assert done.returncode == 0, done.stderr
        assert done.stdout == b"piped in\nhello from /tmp\n"
        done = await c.exec(workspace, "--", "sh", "-c", "kill -TERM $$")
        assert done.returncode == 128 + 15
        done = await c.exec(workspace, "--", "no-such-program")
        assert done.returncode == 12, done.stderr
        assert b"no-such-program" in done.stderr
        done = await c.exec(workspace, "--env", "1BAD=x", "--", "true")
        assert done.returncode == 10
        await copy_in_and_out(c, workspace)
        await port_forward(c, workspace)

        await c.call("POST", f"/v1/workspaces/{workspace}/stop", json={})
        await wait_state(c, workspace, "STOPPED")
        await wait_for_no_targets(c)
        done = await c.exec(workspace, "--", "true")
        assert done.returncode == 13, done.stderr
        assert b"STOPPED" in done.stderr
        done = await c.exec("ws-does-not-exist", "--", "true")
        assert done.returncode == 12
        done = await c.kibo("cp", str(c.base / "kibo.toml"), f"{workspace}:/tmp")
        assert done.returncode == 13, done.stderr
        done = await c.kibo("port-forward", workspace, "8080")
        assert done.returncode == 13, done.stderr
        done = await c.kibo("port-forward", "ws-does-not-exist", "8080")
        assert done.returncode == 12, done.stderr
        done = await c.kibo("port-forward", workspace, "8080:x")
        assert done.returncode == 10, done.stderr


async def copy_in_and_out(c: Cluster, workspace: str) -> None:
    """``kibo workspace cp`` with a credential for ``files`` from ctrl: a file and a tree
    in and back out (the testvmm guest's files live under its agent's --root, which
    exec does not see, so the round trip is the check)."""
    import hashlib

    local = c.base / "cp"
    (local / "tree/sub").mkdir(parents=True)
    data = os.urandom(3 * 1024 * 1024 + 7)
    (local / "blob").write_bytes(data)
    (local / "tree/sub/x.sh").write_bytes(b"#!/bin/sh\n")
    os.chmod(local / "tree/sub/x.sh", 0o755)
    os.symlink("sub/x.sh", local / "tree/link")
    done = await c.kibo("cp", str(local / "blob"), f"{workspace}:/tmp/blob")
    assert done.returncode == 0, done.stderr
    assert hashlib.sha256(data).hexdigest().encode() in done.stderr
    done = await c.kibo("cp", str(local / "tree"), f"{workspace}:/tmp")
    assert done.returncode == 0, done.stderr
    (local / "back").mkdir()
    for src in ("/tmp/blob", "/tmp/tree"):
        done = await c.kibo("cp", f"{workspace}:{src}", str(local / "back"))
        assert done.returncode == 0, done.stderr
    assert (local / "back/blob").read_bytes() == data
    assert (local / "back/tree/sub/x.sh").stat().st_mode & 0o777 == 0o755
    assert os.readlink(local / "back/tree/link") == "sub/x.sh"
    done = await c.kibo("cp", f"{workspace}:/tmp/tree", "-")
    assert done.returncode == 0, done.stderr
    assert b"tree/sub/x.sh" in done.stdout
    done = await c.kibo("cp", f"{workspace}:/no/such", str(local))
    assert done.returncode == 12, done.stderr
    done = await c.kibo("cp", str(local / "blob"), str(local / "other"))
    assert done.returncode == 2, done.stderr


async def port_forward(c: Cluster, workspace: str) -> None:
    """``kibo workspace port-forward`` as its own process with a credential for
    ``ports`` from ctrl: two mappings, 50 concurrent connections with half-close, a
    message on stderr for a port nothing listens on, and Ctrl-C ends it with 0 (the
    testvmm guest's agent runs on this host, so its loopback is this one)."""
    import signal
    import subprocess

    from kibotos.testing.tcp_servers import read_all, tcp_server, upper_after_eof

    nothing = free_port()
    async with tcp_server(upper_after_eof) as upper:
        argv = [*KIBO, "workspace", "port-forward", "--config", str(c.kibo_config),
                workspace, f":{upper}", f"0:{nothing}"]
        proc = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE)
        assert proc.stdout is not None
        assert proc.stderr is not None
        out, err = bytearray(), bytearray()

        async def collect(stream: trio.abc.ReceiveStream, into: bytearray) -> None:
            while chunk := await stream.receive_some():
                into += chunk

        async def ask(port: int, payload: bytes) -> bytes:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(payload)
                await stream.send_eof()
                return await read_all(stream)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(collect, proc.stdout, out)
                nursery.start_soon(collect, proc.stderr, err)
                with trio.fail_after(TIMEOUT):
                    while out.count(b"Forwarding from") < 2:
                        assert proc.poll() is None, bytes(err)
                        await trio.sleep(0.05)
                local = {}
                for line in bytes(out).decode().splitlines():
                    if line.startswith("Forwarding from 127.0.0.1:"):
                        where, _, remote = line.removeprefix("Forwarding from ").partition(
                            " -> ")
                        local[int(remote)] = int(where.rpartition(":")[2])
                answers: dict[int, bytes] = {}

                async def one(i: int) -> None:
                    answers[i] = await ask(local[upper], b"hi %d;" % i * (i + 1))

                with trio.fail_after(TIMEOUT * 2):
                    async with trio.open_nursery() as clients:
                        for i in range(50):
                            clients.start_soon(one, i)
                assert answers == {i: b"HI %d;" % i * (i + 1) for i in range(50)}
                with trio.fail_after(TIMEOUT):
                    with pytest.raises(trio.BrokenResourceError):  # reset: nobody there
                        await ask(local[nothing], b"anyone?")
                    while b"nothing listens on port" not in err:
                        await trio.sleep(0.05)
                proc.send_signal(signal.SIGINT)
                with trio.fail_after(TIMEOUT):
                    assert await proc.wait() == 0, bytes(err)
        finally:
            if proc.returncode is None:
                proc.kill()
    assert f"nothing listens on port {nothing} in the guest".encode() in err
    assert out.count(b"Handling connection for") == 51


async def wait_for_no_targets(c: Cluster) -> None:
    assert c.node.dataplane is not None
    dp = c.node.dataplane.dataplane
    await wait_until(lambda: not dp.targets, "the data plane without targets",
                     timeout=TIMEOUT)


async def test_exec_with_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--tty`` under a real local terminal (a pty): raw mode while it runs and
    restored after, the window size passed on and changed on SIGWINCH."""
    import fcntl
    import signal
    import struct
    import termios

    async with cluster(monkeypatch) as c:
        with trio.fail_after(TIMEOUT):
            while not (await c.call("GET", "/v1/nodes/node-a"))["placement"]["eligible"]:
                await trio.sleep(0.1)
        created = await c.call("POST", "/v1/workspaces", json={
            "template": "tiny", "memory_bytes": 256 << 20, "layer_size_bytes": 64 << 20})
        workspace = created["workspace_id"]
        await wait_state(c, workspace, "AVAILABLE")

        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        cooked = termios.tcgetattr(slave)
        argv = [*KIBO, "workspace", "exec", "--config", str(c.kibo_config), workspace,
                "--tty", "--", "sh", "-c",
                'stty size; while read line; do stty size; test "$line" = q && break; '
                'done; echo "got $line"; exit 3']
        proc = await trio.lowlevel.open_process(argv, stdin=slave, stdout=slave,
                                                stderr=slave)
        terminal = trio.lowlevel.FdStream(master)
        seen = b""

        async def read_until(needle: bytes) -> None:
            nonlocal seen
            with trio.fail_after(TIMEOUT):
                while needle not in seen:
                    chunk = await terminal.receive_some()
                    assert chunk, seen
                    seen += chunk

        try:
            await read_until(b"30 100")
            assert not termios.tcgetattr(slave)[3] & termios.ICANON  # raw while it runs
            fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
            proc.send_signal(signal.SIGWINCH)
            # Each line makes the remote shell print its size again, until the resize
            # (relayed on its own) has arrived; no assumption about how fast.
            with trio.fail_after(TIMEOUT):
                while b"40 120" not in seen:
                    await terminal.send_all(b"\r")
                    with trio.move_on_after(0.5):
                        await read_until(b"40 120")
            await terminal.send_all(b"q\r")
            await read_until(b"got q")
            with trio.fail_after(TIMEOUT):
                assert await proc.wait() == 3
            assert termios.tcgetattr(slave) == cooked  # restored on exit
        finally:
            if proc.returncode is None:
                proc.kill()
            await terminal.aclose()
        text = seen.decode(errors="replace")
        assert text.index("30 100") < text.index("40 120") < text.index("got q")
        os.close(slave)
