"""The checks against a real ``kibotos node serve`` process (talking to a stand-in ctrl):
while it runs, ``check-maintenance`` and ``check-upgrade`` only say the runtime is in
use (the node holds the owner lock) and ``check-upgrade --preview`` works; once it
stopped, both pass though its data-plane process still runs, and the installation it
pinned at start is on disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import trio
from node_helpers import FakeCtrl, free_port, node_config, store_identity

from kibotos.node.runtime import installations

KIBOTOS = [sys.executable, "-m", "kibotos.cli.main"]
RUNTIME = str(installations.default_runtime_dir())


async def run(argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(argv, capture_stdout=True, capture_stderr=True,
                                  check=False)


async def test_checks_against_a_running_then_stopped_node(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "error::ResourceWarning"}
    toml = tmp_path / "node.toml"
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            fake = await nursery.start(FakeCtrl().serve)
            config = node_config(tmp_path, ctrl_url=fake.ctrl_url)
            store_identity(config)
            toml.write_text(toml.read_text().replace("127.0.0.1:7500",
                                                     f"127.0.0.1:{free_port()}"))
            maintenance = [*KIBOTOS, "node", "check-maintenance", "--config", str(toml),
                           "--operation", "upgrade"]
            upgrade = [*KIBOTOS, "node", "check-upgrade", "--config", str(toml),
                       "--runtime-dir", RUNTIME]
            node = await trio.lowlevel.open_process(
                [*KIBOTOS, "node", "serve", "--config", str(toml)], env=env,
                stderr=subprocess.PIPE)
            assert node.stderr is not None
            stderr = b""
            try:
                async with node.stderr:
                    while b"control session established" not in stderr:
                        chunk = await node.stderr.receive_some()
                        assert chunk, stderr.decode()
                        stderr += chunk
                    lock = config.storage.root / "runtime" / "node.lock"
                    in_use = (f"blocked: the runtime is already in use: a node process (pid "
                              f"{node.pid}) holds the owner lock {lock}; stop the node "
                              "service first")
                    result = await run(maintenance)
                    assert result.returncode == 13, result.stdout.decode()
                    assert result.stdout.decode().splitlines() == [
                        in_use, "check-maintenance --operation upgrade: 1 blocking item(s)"]
                    result = await run(upgrade)
                    assert result.returncode == 13
                    assert result.stdout.decode().splitlines()[0] == \
                        in_use + ", or run check-upgrade with --preview"
                    result = await run([*upgrade, "--preview"])
                    assert result.returncode == 0, result.stdout.decode()
                    lines = result.stdout.decode().splitlines()
                    assert lines[-1] == "check-upgrade --preview: passed"
                    assert lines[-2].startswith("note: --preview does not evaluate")
                    node.send_signal(signal.SIGTERM)
                    while chunk := await node.stderr.receive_some():
                        stderr += chunk
            finally:
                if node.returncode is None:
                    node.kill()
            assert await node.wait() == 0, stderr.decode()
            try:
                result = await run(maintenance)
                assert result.returncode == 0, result.stdout.decode()
                result = await run(upgrade)
                assert result.returncode == 0, result.stdout.decode()
                pinned = list((config.storage.root / "installations").iterdir())
                assert len(pinned) == 1
                manifest = json.loads((pinned[0] / "installation.json").read_text())
                assert manifest["identity"] == pinned[0].name
                assert f"installation {pinned[0].name}" in result.stdout.decode()
            finally:
                await trio.run_process([*KIBOTOS, "dataplane", "stop", "--config",
                                        str(toml)], capture_stdout=True, check=False)
            nursery.cancel_scope.cancel()
