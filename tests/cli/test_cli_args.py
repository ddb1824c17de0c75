"""Bad input gets a clear message and the documented exit code, and nothing is sent."""

from __future__ import annotations

import json

import pytest
from cli_invoke import invoke
from cli_nodes import node


@pytest.mark.parametrize(("args", "code", "needle"), [
    # Bad values: invalid_argument, exit code 10, the rule in the message.
    (["node", "get", "Node_A"], 10, "invalid node ID 'Node_A': must be 1-63"),
    (["node", "drain", "node-"], 10, "invalid node ID"),
    (["node", "drain", "node-a", "--command-id", "-bad"], 10, "invalid command ID"),
    (["node", "cancel-drain", "a" * 64], 10, "invalid node ID"),
    (["node", "isolate", "node_a", "--confirm-host-cannot-write"], 10, "invalid node ID"),
    (["node", "retire", "NODE", "--yes"], 10, "invalid node ID"),
    (["node", "overcommit", "set", "node-a", "--cpu", "16.5"], 10,
     "CPU ratio 16.5 is out of range: must be between 0 and 16"),
    (["node", "overcommit", "set", "node-a", "--memory", "-1"], 10, "out of range"),
    (["node", "overcommit", "set", "node-a", "--cpu", "1.2345"], 10,
     "more than three decimal places"),
    (["node", "overcommit", "set", "node-a", "--cpu", "lots"], 10, "expected a decimal"),
    (["node", "overcommit", "set-default", "--cpu", "default"], 10, "expected a decimal"),
    (["node", "overcommit", "set", "Bad", "--cpu", "2"], 10, "invalid node ID"),
    (["node", "list", "--timeout", "soon"], 10, "invalid --timeout"),
    (["enrollment", "create", "--kind", "node", "--node-id", "Bad"], 10, "invalid node ID"),
    (["enrollment", "create", "--kind", "operator", "--expires", "-"], 10, "--expires"),
    (["enrollment", "revoke", "KGR_1"], 10, "invalid grant or identity ID"),
    (["enrollment", "revoke", "node-a"], 10, "must be a grant (kgr-…) or an identity"),
    # Bad combinations of flags: usage errors, exit code 2, naming the flag.
    (["node", "isolate", "node-a"], 2, "--confirm-host-cannot-write is required"),
    (["node", "retire", "node-a", "--yes", "--command-id", "r-1"], 2,
     "--command-id needs --expected-version"),
    (["node", "retire", "node-a"], 2, "without a terminal, add --yes"),
    (["node", "overcommit", "set", "node-a", "--cpu", "2", "--command-id", "oc-1"], 2,
     "--command-id needs --expected-version, --memory"),
    (["node", "overcommit", "set", "node-a", "--cpu", "2", "--memory", "1",
      "--command-id", "oc-1"], 2, "--command-id needs --expected-version"),
    (["node", "overcommit", "set-default", "--cpu", "2", "--expected-version", "1",
      "--command-id", "oc-1"], 2, "--command-id needs --memory"),
    (["node", "overcommit", "set", "node-a"], 2, "give --cpu, --memory or both"),
    (["node", "overcommit", "set-default"], 2, "give --cpu, --memory or both"),
    (["enrollment", "create", "--kind", "node"], 2, "--kind node needs --node-id"),
    (["enrollment", "create", "--kind", "operator", "--node-id", "node-a"], 2,
     "--node-id is only for --kind node"),
    # click's own usage errors keep exit code 2.
    (["node", "drain", "node-a", "--bogus"], 2, "No such option '--bogus'"),
    (["node", "list", "--page-size", "501"], 2, "--page-size"),
    (["node", "drain", "node-a", "--expected-version", "x"], 2, "--expected-version"),
    (["enrollment", "create", "--kind", "robot"], 2, "--kind"),
    (["node", "frobnicate"], 2, "No such command"),
    # issue 16: numbers are ASCII digits, nothing else (no _, no Unicode digit, no space)
    (["node", "overcommit", "set-default", "--cpu", "1_0"], 10, "ASCII digits"),
    (["node", "overcommit", "set-default", "--cpu", "\u0663"], 10, "ASCII digits"),
    (["node", "overcommit", "set-default", "--memory", " 2"], 10, "ASCII digits"),
    (["node", "overcommit", "set-default", "--memory", "1e1"], 10, "ASCII digits"),
    (["workspace", "create", "--template", "base", "--cpu", "\u0663"], 10, "ASCII digits"),
    (["workspace", "create", "--template", "base", "--cpu", "1_0"], 10, "ASCII digits"),
    (["workspace", "create", "--template", "base", "--memory", "\uff11G"], 10, "invalid --memory"),
    (["workspace", "create", "--template", "base", "--memory", "1_0G"], 10, "invalid --memory"),
    (["node", "list", "--timeout", "1_0s"], 10, "invalid --timeout"),
    (["node", "list", "--timeout", "\u0665"], 10, "invalid --timeout"),
    (["node", "list", "--page-size", "1_0"], 2, "ASCII digits"),
    (["node", "list", "--page-size", "\u0665"], 2, "ASCII digits"),
    (["node", "list", "--page-size", " 5"], 2, "ASCII digits"),
    (["node", "drain", "node-a", "--expected-version", "+1"], 2, "ASCII digits"),
    (["workspace", "port-forward", "ws-1", "\u0668\u0660"], 10, "port mapping"),
])
def test_bad_input_sends_nothing(kibo, fake_ctrl, args, code, needle):
    result = kibo(*args)
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert needle in result.stderr
    assert fake_ctrl.requests == []


def test_error_line_and_json_error(kibo, fake_ctrl):
    result = kibo("node", "get", "Node_A", "--json")
    assert result.exit_code == 10
    assert result.stderr.startswith("error: invalid_argument: invalid node ID 'Node_A'")
    assert json.loads(result.stdout)["error"]["code"] == "invalid_argument"
    assert fake_ctrl.requests == []


def test_options_work_after_the_subcommand(kibo, fake_ctrl):
    fake_ctrl.route("GET", "/v1/nodes/node-a", (200, {"result": node()}))
    result = kibo("node", "get", "node-a", "--timeout", "1m", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["result"]["node_id"] == "node-a"


@pytest.mark.parametrize(("content", "needle"), [
    ('ctrl_url = "http://x"\ncredential = \n', "is not valid TOML"),
    ('ctrl_url = "http://x"\ncredentail = "a:b"\n', "credentail: unknown key"),
    ('credential = "a:b"\n', "ctrl_url: Field required"),
    ('ctrl_url = "http://x"\nctrl_ca = "not a certificate"\n', "ctrl_ca: the value"),
    ('ctrl_url = "http://x"\ncluster_ca = 5\n', "cluster_ca: Input should be a valid string"),
])
def test_malformed_config_is_exit_10(tmp_path, content, needle):
    path = tmp_path / "kibo.toml"
    path.write_text(content)
    result = invoke(path, "node", "list")
    assert result.exit_code == 10
    assert str(path) in result.stderr
    assert needle in result.stderr


def test_missing_config_names_the_lookup(tmp_path):
    result = invoke(None, "node", "list", env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert result.exit_code == 10
    assert f"{tmp_path}/kibotos/kibo.toml does not exist" in result.stderr
    assert "kibo enroll" in result.stderr


def test_config_lookup_order(tmp_path, fake_ctrl):
    fake_ctrl.route("GET", "/v1/nodes", (200, {"result": {"nodes": [],
                                                          "next_page_token": None}}))
    good = tmp_path / "good.toml"
    good.write_text(f'ctrl_url = "{fake_ctrl.url}"\n')
    bad = tmp_path / "bad.toml"
    bad.write_text("not toml at all =\n")
    xdg = tmp_path / "xdg" / "kibotos"
    xdg.mkdir(parents=True)
    (xdg / "kibo.toml").write_text("broken =\n")
    # --config beats KIBO_CONFIG, which beats the user's config directory.
    assert invoke(bad, "node", "list", "--config", str(good)).exit_code == 0
    assert invoke(good, "node", "list").exit_code == 0
    assert invoke(None, "node", "list",
                  env={"XDG_CONFIG_HOME": str(tmp_path / "xdg")}).exit_code == 10
