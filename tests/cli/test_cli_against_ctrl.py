"""kibo against a real ctrl process on loopback: enroll, enrollment, drain, cancel-drain,
isolate, retire, overcommit, command-ID replays and stale expected versions.

No node process runs here: nodes are enrolled the way a node enrolls (their grant
exchanged over the API), so they exist with no session (OFFLINE).  Sessions, Instances
and the multi-node walk of spec/nodes.txt are the end-to-end tests' job.
"""

from __future__ import annotations

import json
import stat
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_ctrlproc import BIN, CtrlProcess
from cli_invoke import invoke


@pytest.fixture(scope="module")
def ctrl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CtrlProcess]:
    proc = CtrlProcess(tmp_path_factory.mktemp("ctrl")).start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def operator(ctrl: CtrlProcess) -> Path:
    """A kibo.toml made by `kibo enroll` with a grant from `kibotos ctrl grant`."""
    path = ctrl.root / "operator" / "kibo.toml"
    result = invoke(None, "enroll", *ctrl.enroll_args(), "--grant",
                    ctrl.grant("operator"), "--config", str(path))
    assert result.exit_code == 0, result.stderr
    return path


def kibo(config: Path, *args: str):
    return invoke(config, *args)


def kibo_json(config: Path, *args: str):
    result = invoke(config, *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)["result"]


def test_enroll_wrote_a_private_config(operator):
    assert stat.S_IMODE(operator.stat().st_mode) == 0o600
    assert kibo_json(operator, "enrollment", "list")["identities"][0]["kind"] == "operator"


def test_no_credential_is_refused(ctrl, tmp_path):
    path = tmp_path / "kibo.toml"
    path.write_text(f'ctrl_url = "{ctrl.url}"\n'
                    f'ctrl_ca = {json.dumps(ctrl.ca_file.read_text())}\n')
    result = kibo(path, "node", "list")
    assert result.exit_code == 11
    assert result.stderr.startswith("error: unauthenticated:")


def test_enroll_refuses_a_ctrl_it_cannot_verify(ctrl, tmp_path):
    """Without ctrl's CA pinned, the system store does not know the cluster CA: the
    handshake fails, nothing is written and the grant is not used."""
    token = ctrl.grant("operator")
    path = tmp_path / "kibo.toml"
    result = invoke(None, "enroll", "--ctrl-url", ctrl.url, "--grant", token,
                    "--config", str(path))
    assert result.exit_code == 13, result.stderr
    assert "does not verify" in result.stderr
    assert "--ca-file" in result.stderr
    assert not path.exists()
    # The grant is still good: with the CA pinned the same token works.
    result = invoke(None, "enroll", *ctrl.enroll_args(), "--grant", token,
                    "--config", str(path))
    assert result.exit_code == 0, result.stderr
    written = tomllib.loads(path.read_text())
    assert written["ctrl_ca"] == ctrl.ca_file.read_text()
    assert written["cluster_ca"] == ctrl.ca_file.read_text()


def test_enroll_refuses_plain_http_off_loopback(tmp_path):
    path = tmp_path / "kibo.toml"
    result = invoke(None, "enroll", "--ctrl-url", "http://192.0.2.1:7400", "--grant",
                    "kgr-1.abc", "--config", str(path))
    assert result.exit_code == 10, result.stderr
    assert "must be https://" in result.stderr
    assert not path.exists()


def test_a_node_identity_cannot_act_as_operator(ctrl, operator, tmp_path):
    token = ctrl.grant("node", "node-x")
    path = tmp_path / "kibo.toml"
    result = invoke(None, "enroll", *ctrl.enroll_args(), "--grant", token,
                    "--config", str(path))
    assert result.exit_code == 13
    assert "not an operator" in result.stderr
    assert not path.exists()


def test_list_and_get_an_offline_node(ctrl, operator):
    ctrl.enroll_node("node-list")
    nodes = kibo_json(operator, "node", "list", "--all")["nodes"]
    row = next(n for n in nodes if n["node_id"] == "node-list")
    assert row["status"] == "OFFLINE"
    table = kibo(operator, "node", "list", "--all", "--wide").stdout
    line = next(x for x in table.splitlines() if "| node-list " in x)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells == ["node-list", "OFFLINE", "-", "-", "-", "-/0", "-/0B", "no",
                     str(row["registration_version"])]
    got = kibo(operator, "node", "get", "node-list")
    assert got.exit_code == 0
    assert "Status:" in got.stdout
    assert "Latest session\n  Session: - (the node has never connected)" in got.stdout
    missing = kibo(operator, "node", "get", "node-nope")
    assert missing.exit_code == 12


def test_list_pages_on_the_server(ctrl, operator):
    for i in range(3):
        ctrl.enroll_node(f"page-{i}")
    first = kibo_json(operator, "node", "list", "--page-size", "1")
    assert len(first["nodes"]) == 1
    assert first["next_page_token"]
    every = kibo_json(operator, "node", "list", "--page-size", "1", "--all")
    ids = [n["node_id"] for n in every["nodes"]]
    assert ids == sorted(ids)
    assert {"page-0", "page-1", "page-2"} <= set(ids)
    assert every["next_page_token"] is None


def test_drain_stale_version_replay_and_conflict(ctrl, operator):
    ctrl.enroll_node("node-d")
    version = kibo_json(operator, "node", "get", "node-d")["registration_version"]
    stale = kibo(operator, "node", "drain", "node-d", "--expected-version", str(version - 1))
    assert stale.exit_code == 14
    assert kibo_json(operator, "node", "get", "node-d")["drain_requested"] is False

    args = ("node", "drain", "node-d", "--command-id", "drain-d",
            "--expected-version", str(version))
    first = kibo_json(operator, *args)
    assert first["status"] == "DRAINED"  # no instances, no volumes
    assert first["registration_version"] == version + 1
    assert kibo_json(operator, *args) == first  # the replay returns the stored result
    other = kibo(operator, "node", "drain", "node-d", "--command-id", "drain-d",
                 "--expected-version", str(version + 1))
    assert other.exit_code == 14
    assert result_code(other) == "already_exists"


def result_code(result) -> str:
    return result.stderr.split(":", 2)[1].strip()


def test_drain_wait_on_an_empty_node_and_cancel(ctrl, operator):
    ctrl.enroll_node("node-w")
    waited = kibo(operator, "node", "drain", "node-w", "--wait", "--timeout", "1m")
    assert waited.exit_code == 0, waited.stderr
    assert "status DRAINED" in waited.stdout
    cancelled = kibo_json(operator, "node", "cancel-drain", "node-w")
    assert cancelled["drain_requested"] is False
    assert cancelled["status"] == "OFFLINE"


def test_isolate_then_retire_is_final(ctrl, operator):
    ctrl.enroll_node("node-i")
    refused = kibo(operator, "node", "retire", "node-i", "--yes")
    assert refused.exit_code == 13  # OFFLINE: neither DRAINED nor isolated
    isolated = kibo(operator, "node", "isolate", "node-i", "--confirm-host-cannot-write")
    assert isolated.exit_code == 0, isolated.stderr
    assert isolated.stdout == ("isolated node node-i: released 0 volume(s) and 0 retained "
                               "layer(s); 0 workspace(s) moved to FAILED\n")
    version = kibo_json(operator, "node", "get", "node-i")["registration_version"]
    retired = kibo_json(operator, "node", "retire", "node-i", "--yes", "--command-id",
                        "retire-i", "--expected-version", str(version))
    assert retired["status"] == "RETIRED"
    for args in (("node", "drain", "node-i"),
                 ("node", "isolate", "node-i", "--confirm-host-cannot-write"),
                 ("enrollment", "create", "--kind", "node", "--node-id", "node-i")):
        assert kibo(operator, *args).exit_code == 13, args


def test_overcommit_set_and_default(ctrl, operator):
    ctrl.enroll_node("node-o")
    node = kibo_json(operator, "node", "overcommit", "set", "node-o", "--cpu", "2.50")
    assert node["overcommit"]["cpu"] == {"ratio": "2.5", "source": "override"}
    assert node["overcommit"]["memory"]["source"] == "default"
    shown = kibo(operator, "node", "overcommit", "get").stdout
    assert "| node-o | 2.5 | default |" in shown
    back = kibo_json(operator, "node", "overcommit", "set", "node-o", "--cpu", "default")
    assert back["overcommit"]["cpu"]["source"] == "default"

    before = kibo_json(operator, "node", "overcommit", "get")
    args = ("node", "overcommit", "set-default", "--cpu", "3", "--memory", "1.5",
            "--command-id", "oc-default", "--expected-version", str(before["version"]))
    after = kibo_json(operator, *args)
    assert after["default"] == {"cpu": "3", "memory": "1.5"}
    assert after["version"] == before["version"] + 1
    assert kibo_json(operator, *args) == after  # replay
    stale = kibo(operator, "node", "overcommit", "set-default", "--cpu", "2",
                 "--expected-version", str(before["version"]))
    assert stale.exit_code == 14


def test_bad_input_changes_nothing_in_ctrl(ctrl, operator):
    before = kibo_json(operator, "node", "overcommit", "get")
    for args in (("--cpu", "17"), ("--cpu", "1.0001"), ("--memory", "-0.5")):
        assert kibo(operator, "node", "overcommit", "set-default", *args).exit_code == 10
    assert kibo_json(operator, "node", "overcommit", "get") == before


def test_enrollment_create_list_revoke(ctrl, operator):
    ctrl.enroll_node("node-r")
    made = kibo(operator, "enrollment", "create", "--kind", "operator", "--name", "bob",
                "--expires", "30m")
    assert made.exit_code == 0
    token = made.stdout.strip()
    assert token.startswith("kgr-")
    listing = kibo_json(operator, "enrollment", "list")
    grant = next(g for g in listing["grants"] if g["name"] == "bob")
    assert grant["state"] == "pending"
    revoked = kibo(operator, "enrollment", "revoke", grant["grant_id"])
    assert revoked.stdout == f"revoked {grant['grant_id']}\n"
    node_identity = next(i for i in listing["identities"] if i["node_id"] == "node-r")
    kibo(operator, "enrollment", "revoke", node_identity["identity_id"])
    node = kibo_json(operator, "node", "get", "node-r")
    assert node["admission"] == "revoked"
    assert node["status"] == "REVOKED"


def test_the_console_script_exit_codes(ctrl, operator):
    exe = BIN / "kibo"
    if not exe.exists():
        pytest.skip("the kibo console script is not installed in this environment")
    env = {"KIBO_CONFIG": str(operator), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([str(exe), "node", "get", "node-missing"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 12
    assert done.stderr.startswith("error: not_found:")


@pytest.mark.slow
def test_replay_survives_a_ctrl_restart(tmp_path):
    ctrl = CtrlProcess(tmp_path).start()
    try:
        path = tmp_path / "kibo.toml"
        assert invoke(None, "enroll", *ctrl.enroll_args(), "--grant",
                      ctrl.grant("operator"), "--config", str(path)).exit_code == 0
        ctrl.enroll_node("node-z")
        first = kibo_json(path, "node", "drain", "node-z", "--command-id", "drain-z")
        ctrl.stop()
        ctrl.start()
        path.write_text(path.read_text().replace(
            path.read_text().split('"')[1], ctrl.url))  # the new port
        kibo_json(path, "node", "cancel-drain", "node-z")
        assert kibo_json(path, "node", "drain", "node-z", "--command-id", "drain-z") == first
        assert kibo_json(path, "node", "get", "node-z")["drain_requested"] is False
    finally:
        ctrl.stop()
