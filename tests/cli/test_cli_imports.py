"""A ``kibo`` command imports only what it uses (issue 14: within 0.25 s).

Speed itself is bench/cli.py's to measure; this checks its cause, which does not vary
with the machine: the whole ``kibo`` process, run for real against the fake ctrl,
never imports the heavy libraries that made every command take most of a second
(pydantic, httpx and httpcore, rich, trio and trio-websocket, cryptography, SQLAlchemy;
wsproto, whose import builds a 64 Ki-entry table), and the commands that need one of
them still import it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_nodes import node

HEAVY = ("pydantic", "httpx", "httpcore", "rich", "trio", "trio_websocket", "cryptography",
         "sqlalchemy", "anyio", "h2", "wsproto")
WS = "ws-01k6aaaaaaaaaaaaaaaaaaaaaa"

# Runs kibo's entry point and writes the names of every module imported by the end.
_PROBE = """
import atexit, json, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
sys.argv[0] = "kibo"
from kibotos.cli.main import kibo_main
kibo_main()
"""


def imported(tmp_path: Path, kibo_toml: Path, *args: str,
             terminal: bool = False) -> tuple[int, set[str]]:
    """Run kibo ARGS (stdout a pipe, or a pseudo-terminal); its exit code and the
    modules it imported, with their top-level packages."""
    out = tmp_path / "modules.json"
    env = {**os.environ, "KIBO_CONFIG": str(kibo_toml)}
    env.pop("KIBO_ASCII", None)
    master, slave = os.openpty() if terminal else (-1, -1)
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, str(out), *args], env=env,
                              stdout=slave if terminal else subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=60, check=False)
    finally:
        if terminal:
            os.close(slave)
            os.close(master)
    names = set(json.loads(out.read_text()))
    return done.returncode, names | {name.partition(".")[0] for name in names}


def heavy(modules: set[str]) -> list[str]:
    return sorted(set(HEAVY) & modules)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("args", [
    ("--help",), ("workspace", "--help"), ("node", "list"), ("workspace", "list"),
    ("node", "list", "--json"), ("node", "get", "node-a"), ("workspace", "exec", WS, "--",
                                                            "true"),
    ("completion", "bash"),
])
def test_commands_import_nothing_heavy(tmp_path, kibo_toml, fake_ctrl, args):
    fake_ctrl.route("GET", "/v1/nodes", (200, {"result": {"nodes": [node()],
                                                          "next_page_token": None}}))
    fake_ctrl.route("GET", "/v1/nodes/node-a", (200, {"result": node()}))
    fake_ctrl.route("GET", "/v1/workspaces", (200, {"result": {"workspaces": [],
                                                               "next_page_token": None}}))
    # exec: a data plane that refuses the connection (exit 17) has the exec path's
    # imports done by then (the client end is imported before it connects).
    fake_ctrl.route("POST", f"/v1/workspaces/{WS}/sessions", (200, {"result": {
        "dataplane_url": f"http://127.0.0.1:{closed_port()}", "credential": "x"}}))
    code, modules = imported(tmp_path, kibo_toml, *args)
    assert code == (17 if "exec" in args else 0)
    assert heavy(modules) == []
    exec_path = {"kibotos.cli.workspace.exec_relay", "kibotos.dataplane.clients.ws_client"}
    assert exec_path <= modules if "exec" in args else not exec_path & modules


def test_a_terminal_and_wide_text_still_get_rich(tmp_path, kibo_toml, fake_ctrl):
    """Only the plain path does without rich: a terminal gets rich's rounded table, and
    text whose width rich must measure (a wide character) goes to rich in a pipe too."""
    fake_ctrl.route("GET", "/v1/nodes", (200, {"result": {
        "nodes": [node()], "next_page_token": None}}))
    code, modules = imported(tmp_path, kibo_toml, "node", "list", terminal=True)
    assert (code, "rich" in modules) == (0, True)
    fake_ctrl.route("GET", "/v1/nodes", (200, {"result": {
        "nodes": [node(node_id="node-表")], "next_page_token": None}}))
    code, modules = imported(tmp_path, kibo_toml, "node", "list")
    assert (code, "rich" in modules) == (0, True)


def test_enroll_still_imports_cryptography(tmp_path, fake_ctrl):
    fake_ctrl.route("POST", "/v1/enrollment/exchange", (200, {"result": {
        "kind": "operator", "identity_id": "kid-1", "credential": "kid-1:s", "node_id": None}}))
    config = tmp_path / "conf" / "kibo.toml"
    code, modules = imported(tmp_path, config, "enroll", "--ctrl-url", fake_ctrl.url,
                             "--grant", "kgr-a.b")
    assert code == 0
    assert "cryptography" in modules
