"""`kibotos dev cluster up|status|down` as a newcomer runs it, from the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from kibotos.dev import ClusterError, DevCluster
from kibotos.dev.cluster import script

pytestmark = pytest.mark.slow


def _kibotos(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([script("kibotos"), *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, check=False)


def _status(directory: Path) -> dict[str, dict]:
    proc = _kibotos("dev", "cluster", "status", "--dir", str(directory), "--json")
    assert proc.returncode == 0, proc.stderr
    return {p["name"]: p for p in json.loads(proc.stdout)["result"]["processes"]}


def test_up_status_down_from_the_command_line(tmp_path):
    d = tmp_path / "c"
    try:
        up = _kibotos("dev", "cluster", "up", "--dir", str(d), "--nodes", "2",
                      "--shared-pool", "--cpu", "2", "--memory", "4G", "--timeout", "120s")
        assert up.returncode == 0, up.stderr
        assert up.stdout.strip() == f"export KIBO_CONFIG={d / 'kibo.toml'}"

        # Files where docs/dev.md says they are.
        for node_id in ("node-1", "node-2"):
            nd = d / "nodes" / node_id
            for name in ("node.toml", "node.log", "node.pid", "grant"):
                assert (nd / name).is_file(), nd / name
            assert (nd / "pool").is_dir()
        assert (d / "shared-pool").is_dir()
        assert (d / "ctrl" / "ctrl.log").is_file()

        status = _status(d)
        assert set(status) == {"ctrl", "node-1", "node-2", "e2b-gateway", "exposure-gateway"}
        assert all(p["running"] and p["pid"] for p in status.values())
        # Both gateways by default, and what an SDK script needs (docs/dev.md).
        env_file = d / "e2b.env"
        assert env_file.stat().st_mode & 0o777 == 0o600
        settings = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
        assert set(settings) == {"E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY",
                                 "E2B_DOMAIN", "KIBOTOS_EXPOSURE_URL"}
        assert settings["E2B_DOMAIN"] == "kibotos.localhost"
        unrouted = httpx.get(settings["KIBOTOS_EXPOSURE_URL"] + "/", timeout=30)
        assert unrouted.status_code == 404
        assert "<port>-<sandbox>.kibotos.localhost" in unrouted.text
        assert status["node-1"]["node_status"] == "READY"
        assert status["node-2"]["node_status"] == "READY"

        # kibo reads KIBO_CONFIG, as the printed line says.
        env = {**os.environ, "KIBO_CONFIG": str(d / "kibo.toml")}
        listed = subprocess.run([script("kibo"), "node", "list", "--json"], env=env,
                                capture_output=True, text=True, timeout=60, check=False)
        assert listed.returncode == 0, listed.stderr
        nodes = json.loads(listed.stdout)["result"]["nodes"]
        assert [n["node_id"] for n in nodes] == ["node-1", "node-2"]
        assert {n["resources"]["cpu_millis"] for n in nodes} == {2000}
        assert {n["resources"]["memory_bytes"] for n in nodes} == {4 * 2**30}

        # A second `up` on a running cluster says so and fails.
        again = _kibotos("dev", "cluster", "up", "--dir", str(d), "--nodes", "2")
        assert again.returncode != 0
        assert "already running" in again.stderr

        human = _kibotos("dev", "cluster", "status", "--dir", str(d))
        assert human.returncode == 0
        assert "PROCESS" in human.stdout
        assert "READY" in human.stdout

        down = _kibotos("dev", "cluster", "down", "--dir", str(d))
        assert down.returncode == 0, down.stderr
        status = _status(d)
        assert not any(p["running"] for p in status.values())
        assert not (d / "ctrl" / "ctrl.pid").exists()

        # The stopped cluster's DIR is not silently reused.
        reuse = _kibotos("dev", "cluster", "up", "--dir", str(d))
        assert reuse.returncode != 0
        assert "not empty" in reuse.stderr
    finally:
        DevCluster(d).down(grace=5)


def test_a_node_killed_and_started_again_by_hand(tmp_path):
    """The issue's promise: a test can kill a node and start it again with
    `kibotos node serve --config DIR/nodes/<id>/node.toml`."""
    c = DevCluster(tmp_path / "c", timeout=120)
    try:
        c.up(nodes=1)
        before = c.node("node-1")["latest_session"]["incarnation"]
        assert c.kill_node("node-1", signal.SIGKILL) == -signal.SIGKILL
        assert "node-1" not in c.running()
        c.wait_status(["node-1"], "OFFLINE")

        node_dir = c.layout.node_dir("node-1")
        with open(node_dir / "node.log", "ab") as log:
            proc = subprocess.Popen(
                [script("kibotos"), "node", "serve", "--config", str(node_dir / "node.toml")],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        (node_dir / "node.pid").write_text(f"{proc.pid}\n")  # so `down` knows it
        try:
            c.wait_ready(["node-1"])
            assert c.node("node-1")["latest_session"]["incarnation"] > before
        finally:
            assert c.running() == ["ctrl", "node-1"]
            assert c.down() == ["node-1", "ctrl"]
            assert proc.wait(timeout=60) == 0  # a clean stop on SIGTERM
    finally:
        c.down(grace=5)


def test_up_fails_naming_the_node_and_why(tmp_path):
    """A node that cannot start: `up` fails, names it, shows its log, stops the rest."""
    c = DevCluster(tmp_path / "c", timeout=120)
    with pytest.raises(ClusterError) as info:
        # A failpoint kills each node right after it persisted its incarnation.
        c.up(nodes=2, node_env={"KIBOTOS_FAILPOINTS": "node.incarnation.after-write=kill"})
    message = str(info.value)
    assert "node-1" in message
    assert "exited" in message
    assert "node.log" in message
    assert c.running() == []


def test_status_of_a_directory_without_a_cluster(tmp_path):
    proc = _kibotos("dev", "cluster", "status", "--dir", str(tmp_path))
    assert proc.returncode == 12
    assert "holds no dev cluster" in proc.stderr


def test_bad_options_are_refused_before_anything_is_written(tmp_path):
    d = tmp_path / "c"
    for args, code in ((("--nodes", "0"), 2), (("--timeout", "soon"), 2),
                       (("--memory", "lots"), 10), (("--cpu", "-1"), 10),
                       (("--store", "mysql"), 2), (("--ctrl-replicas", "0"), 2),
                       (("--ctrl-replicas", "2"), 10)):
        proc = _kibotos("dev", "cluster", "up", "--dir", str(d), *args)
        assert proc.returncode == code, (args, proc.stderr)
        assert not d.exists() or not any(d.iterdir()), args

