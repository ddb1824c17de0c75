"""`kibotos node serve` as a real process: config errors (exit 10, nothing written), a
missing pool (the spec's message), a clean stop on SIGTERM, and exit 75 after isolate."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from node_helpers import Conn, FakeCtrl, free_port, node_config, store_identity, write_config

KIBOTOS = [sys.executable, "-m", "kibotos.cli.main"]


def _serve(config: Path, *, tool: str = "kibotos") -> subprocess.CompletedProcess[str]:
    argv = [*KIBOTOS, "node"] if tool == "kibotos" else [
        sys.executable, "-c", "from kibotos.cli.main import kibotos_node_main as m; m()"]
    return subprocess.run([*argv, "serve", "--config", str(config)], capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.parametrize(("mutate", "expected"), [
    (lambda t: t.replace("[node]", "[node", 1), "is not valid TOML"),
    (lambda t: t + "\n[storage.extra]\nx = 1\n", "storage.extra: unknown key"),
    (lambda t: t.replace("[resources]", "[resources]\ncpus = 3", 1), "resources.cpus: unknown key"),
    (lambda t: t.replace('id = "node-a"', 'id = "Node_A"', 1), "node.id: invalid node ID"),
    (lambda t: t.replace('cpu = 2.5', 'cpu = "many"', 1), "cpu must be a number of cores"),
    (lambda t: t.replace('memory = "4G"', 'memory = "4 parsecs"', 1), "invalid memory"),
    (lambda t: t.replace('default = true', 'default = true\ncapacity = "1T"', 1),
     "storage.pool.capacity was removed"),
], ids=["toml", "unknown-section", "unknown-key", "node-id", "cpu", "memory", "capacity"])
def test_bad_config_exits_10_and_writes_nothing(tmp_path: Path, mutate, expected: str) -> None:
    path = write_config(tmp_path)
    path.write_text(mutate(path.read_text()))
    proc = _serve(path)
    assert proc.returncode == 10, proc.stderr
    assert expected in proc.stderr
    assert str(path) in proc.stderr
    assert proc.stdout == ""
    assert not (tmp_path / "root").exists()


def test_missing_config_file(tmp_path: Path) -> None:
    proc = _serve(tmp_path / "absent.toml", tool="kibotos-node")
    assert proc.returncode == 10
    assert "absent.toml does not exist" in proc.stderr


def test_missing_pool_directory_logs_the_spec_message(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    shutil.rmtree(tmp_path / "pool-a")  # initialized, then gone (not mounted)
    proc = _serve(path)
    assert proc.returncode == 13, proc.stderr
    assert f"prepare host layout: create {tmp_path / 'pool-a'}/volumes" in proc.stderr
    assert not (tmp_path / "pool-a").exists()


async def test_sigterm_stops_cleanly_and_isolate_exits_75(tmp_path: Path) -> None:
    isolate = False

    async def script(conn: Conn) -> None:
        if isolate:
            await conn.send(type="rejected", reason="isolated", message="declared by test")
            await conn.ws.aclose()
            return
        await conn.send(type="welcome", session_id=f"ses-{conn.number}")
        while True:
            await conn.receive()

    env = {**os.environ, "PYTHONWARNINGS": "error::ResourceWarning"}
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            fake = await nursery.start(FakeCtrl(script).serve)
            config = node_config(tmp_path, ctrl_url=fake.ctrl_url)
            store_identity(config)
            # `kibotos node serve` runs its data plane: give it a port of its own.
            toml = tmp_path / "node.toml"
            toml.write_text(toml.read_text().replace("127.0.0.1:7500",
                                                     f"127.0.0.1:{free_port()}"))
            argv = [*KIBOTOS, "node", "serve", "--config", str(tmp_path / "node.toml")]

            process = await trio.lowlevel.open_process(argv, env=env, stderr=subprocess.PIPE)
            assert process.stderr is not None
            stderr = b""
            established = b"control session established"
            async with process.stderr:
                # SIGTERM only once the node says the session is up: the fake accepting
                # the connection is not yet the node having read its welcome.
                while established not in stderr:
                    chunk = await process.stderr.receive_some()
                    assert chunk, stderr.decode()
                    stderr += chunk
                process.send_signal(signal.SIGTERM)
                while chunk := await process.stderr.receive_some():
                    stderr += chunk
            assert await process.wait() == 0
            text = stderr.decode()
            assert "control session established session_id=ses-1 incarnation=1" in text
            assert "node stopping signal=SIGTERM" in text

            isolate = True
            result = await trio.run_process(argv, env=env, capture_stderr=True, check=False)
            assert result.returncode == 75, result.stderr.decode()
            text = result.stderr.decode()
            assert "ctrl says this node was isolated" in text
            assert "node exiting after isolate" in text
            assert fake.conns[-1].hello["incarnation"] == 2
            # `kibotos node serve` started its data plane, which outlives the node.
            stop = await trio.run_process([*KIBOTOS, "dataplane", "stop", "--config",
                                           str(tmp_path / "node.toml")],
                                          capture_stdout=True, check=True)
            assert b"stopped kibotos-dataplane-" in stop.stdout
            nursery.cancel_scope.cancel()
