"""``kibo egress``, ``kibo resolver`` and the network parts of ``kibo workspace``
(create's policy flags, set-network, the policy in ``get``) against the recording fake
ctrl: what is sent (and nothing on bad input), the password read from a file and sent
only over TLS or loopback, rendering, and docs/cli.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest
from cli_invoke import invoke

from kibotos.cli.main import kibo_cli

WS = "ws-01k6aaaaaaaaaaaaaaaaaaaaaa"
INST = "inst-01k6bbbbbbbbbbbbbbbbbbbbbb"
DOC = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
SECRET = "correct-horse-battery-staple"
STAMP = "2026-11-29T15:00:00.000Z"


def ok(value: Any) -> tuple[int, Any]:
    return 200, {"result": value}


def egress(**changes: Any) -> dict[str, Any]:
    out = {"name": "corp", "address": "proxy.example:1080", "authenticated": True,
           "username": "alice", "revision": 1, "created_at": STAMP, "updated_at": STAMP}
    out.update(changes)
    return out


def resolver(**changes: Any) -> dict[str, Any]:
    out = {"name": "dns", "upstream": "10.0.0.53:53", "via_egress": None, "revision": 1,
           "created_at": STAMP, "updated_at": STAMP}
    out.update(changes)
    return out


def ws(**changes: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "workspace_id": WS,
        "template": {"name": "base", "image_digest": "sha256:" + "a" * 64,
                     "kernel_digest": "sha256:" + "b" * 64,
                     "initramfs_digest": "sha256:" + "c" * 64},
        "labels": {}, "state": "AVAILABLE", "reason": None, "revision": 5,
        "resources": {"cpu_millis": 1000, "memory_bytes": 1 << 30},
        "layer": {"pool_id": "node-a-local", "ref": "lay-x", "size_bytes": 10 << 30,
                  "handoff": None},
        "network": {"policy": None, "revision": 1},
        "node_id": "node-a", "instance_id": INST, "last_node_id": "node-a",
        "last_instance_id": INST, "created_at": STAMP, "updated_at": STAMP,
        "deleted_at": None,
        "instance": {"instance_id": INST, "node_id": "node-a", "state": "RUNNING",
                     "reason": None, "guest": {"boot_id": "b-1", "capabilities": []},
                     "confirmed_on_disk": None, "network": None, "network_revision": None,
                     "addresses": None},
    }
    out.update(changes)
    return out


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "socks-password"
    path.write_text(SECRET + "\n")
    return path


# ------------------------------------------------------------------------ egress


def test_egress_create_reads_the_password_file(kibo, fake_ctrl, password_file):
    fake_ctrl.route("POST", "/v1/egresses", ok(egress()))
    result = kibo("egress", "create", "corp", "--address", "Proxy.Example:1080",
                  "--username", "alice", "--password-file", str(password_file),
                  "--command-id", "e-1")
    assert result.exit_code == 0, result.stderr
    assert fake_ctrl.sent("POST")[0].body == {
        "name": "corp", "address": "proxy.example:1080", "username": "alice",
        "password": SECRET, "command_id": "e-1"}
    assert result.stdout == ("egress corp: created, revision 1 (proxy.example:1080, "
                             "authenticated as alice)\n")
    assert SECRET not in result.stdout + result.stderr


def test_egress_password_from_stdin(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/egresses", ok(egress()))
    result = kibo("egress", "create", "corp", "--address", "p:1", "--username", "alice",
                  "--password-file", "-", input=f"{SECRET}\r\n")
    assert result.exit_code == 0, result.stderr
    assert fake_ctrl.sent("POST")[0].body["password"] == SECRET


def test_no_password_in_clear_text_off_loopback(tmp_path, password_file):
    config = tmp_path / "remote.toml"
    # Nothing listens there: the refusal comes before any connection.
    config.write_text('ctrl_url = "http://192.0.2.1:7400"\ncredential = "kid-x:s"\n')
    result = invoke(config, "egress", "create", "corp", "--address", "p:1", "--username",
                    "alice", "--password-file", str(password_file))
    assert result.exit_code == 13
    assert "in clear text" in result.stderr
    assert SECRET not in result.stderr


@pytest.mark.parametrize(("args", "code"), [
    (["create", "Corp", "--address", "p:1"], 10),
    (["create", "corp", "--address", "p"], 10),
    (["create", "corp", "--address", "p:0"], 10),
    (["create", "corp", "--address", "p:080"], 10),
    (["create", "corp", "--address", "p:١٠"], 10),
    (["create", "corp", "--address", "2001:db8::1:1080"], 10),
    (["create", "corp", "--address", "p:1", "--username", "alice"], 2),
    (["create", "corp", "--address", "p:1", "--password-file", "/nonexistent"], 2),
    (["create", "corp", "--address", "p:1", "--username", "a", "--password-file",
      "/nonexistent"], 10),
    (["create", "corp"], 2),
    (["get", "x-"], 10),
    (["update", "corp"], 2),
    (["update", "corp", "--address", "p:99999"], 10),
    (["update", "corp", "--no-credentials", "--username", "a"], 2),
    (["delete", "Corp"], 10),
])
def test_bad_egress_input_sends_nothing(kibo, fake_ctrl, args, code):
    result = kibo("egress", *args)
    assert result.exit_code == code, result.output
    assert fake_ctrl.requests == []


def test_an_empty_or_long_password_file_sends_nothing(kibo, fake_ctrl, tmp_path):
    for content in (b"\n", b"x" * 256, b"\xff\xfe"):
        path = tmp_path / "pw"
        path.write_bytes(content)
        result = kibo("egress", "create", "corp", "--address", "p:1", "--username", "a",
                      "--password-file", str(path))
        assert result.exit_code == 10, result.output
    assert fake_ctrl.requests == []


def test_egress_list_get_update_delete(kibo, fake_ctrl, password_file):
    fake_ctrl.route("GET", "/v1/egresses", ok({"egresses": [
        egress(), egress(name="open", authenticated=False, username=None, revision=3)]}))
    result = kibo("egress", "list")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].split("|")[1:-1] == [
        " NAME ", " ADDRESS            ", " AUTHENTICATED ", " USERNAME ", " REVISION ",
        " UPDATED                  "]
    assert "| corp | proxy.example:1080 | yes           | alice    | 1        |" in \
        result.stdout
    assert "| open | proxy.example:1080 | no            | -        | 3        |" in \
        result.stdout
    fake_ctrl.route("GET", "/v1/egresses/corp", ok(egress()))
    result = kibo("egress", "get", "corp")
    assert result.stdout.splitlines()[:5] == [
        "Egress corp", "  Address:       proxy.example:1080", "  Authenticated: yes",
        "  Username:      alice", "  Revision:      1"]
    fake_ctrl.route("POST", "/v1/egresses/corp/update", ok(
        {"egress": egress(revision=2, username="bob"), "outcome": "updated"}))
    result = kibo("egress", "update", "corp", "--username", "bob", "--password-file",
                  str(password_file), "--expected-version", "1")
    assert result.exit_code == 0, result.stderr
    body = fake_ctrl.sent("POST")[-1].body
    assert {k: body[k] for k in ("username", "password", "expected_version")} == {
        "username": "bob", "password": SECRET, "expected_version": 1}
    assert result.stdout == ("egress corp: updated, revision 2 (proxy.example:1080, "
                             "authenticated as bob)\n")
    result = kibo("egress", "update", "corp", "--no-credentials")
    assert fake_ctrl.sent("POST")[-1].body["clear_credentials"] is True
    fake_ctrl.route("DELETE", "/v1/egresses/corp", ok(egress(revision=2)))
    result = kibo("egress", "delete", "corp", "--expected-version", "2")
    assert result.exit_code == 0, result.stderr
    assert fake_ctrl.sent("DELETE")[0].body["expected_version"] == 2
    assert result.stdout == "egress corp deleted (it was at revision 2)\n"


def test_a_refused_delete_names_the_workspaces(kibo, fake_ctrl):
    fake_ctrl.route("DELETE", "/v1/egresses/corp", (400, {"error": {
        "code": "failed_precondition",
        "message": f"egress corp is used by Workspace {WS}: delete those Workspaces or "
                   "change their network policy first (`kibo workspace set-network`)",
        "details": {"name": "corp", "workspaces": [WS]}}}))
    result = kibo("egress", "delete", "corp")
    assert result.exit_code == 13
    assert WS in result.stderr


# ------------------------------------------------------------------------ resolver


def test_resolver_commands(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/resolvers", ok(resolver(via_egress="corp")))
    result = kibo("resolver", "create", "dns", "--upstream", "10.0.0.53", "--via-egress",
                  "corp")
    assert result.exit_code == 0, result.stderr
    assert fake_ctrl.sent("POST")[0].body == {
        "name": "dns", "upstream": "10.0.0.53:53", "via_egress": "corp",
        "command_id": fake_ctrl.sent("POST")[0].body["command_id"]}
    assert result.stdout == "resolver dns: created, revision 1 (10.0.0.53:53 via egress corp)\n"
    fake_ctrl.route("GET", "/v1/resolvers", ok({"resolvers": [resolver()]}))
    result = kibo("resolver", "list")
    assert "| dns  | 10.0.0.53:53 | -          | 1        |" in result.stdout
    fake_ctrl.route("GET", "/v1/resolvers/dns", ok(resolver()))
    assert "  Upstream:   10.0.0.53:53" in kibo("resolver", "get", "dns").stdout
    fake_ctrl.route("DELETE", "/v1/resolvers/dns", ok(resolver()))
    assert kibo("resolver", "delete", "dns").stdout == "resolver dns deleted\n"


@pytest.mark.parametrize("args", [
    ["create", "dns", "--upstream", "10.0.0.53:0"], ["create", "dns", "--upstream", "a b"],
    ["create", "DNS", "--upstream", "10.0.0.53"],
    ["create", "dns", "--upstream", "10.0.0.53", "--via-egress", "-x"],
    ["get", "x."], ["delete", ".x"],
])
def test_bad_resolver_input_sends_nothing(kibo, fake_ctrl, args):
    assert kibo("resolver", *args).exit_code == 10
    assert fake_ctrl.requests == []


# ------------------------------------------------------------------------ workspace


def test_workspace_create_with_a_policy(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/workspaces", ok(ws(state="CREATING")))
    result = kibo("workspace", "create", "--template", "base", "--no-wait",
                  "--allow-out", "198.18.0.10", "--deny-out", "0.0.0.0/0", "--deny-out",
                  "::/0", "--no-public-egress", "--egress", "corp", "--resolver", "dns")
    assert result.exit_code == 0, result.stderr
    assert fake_ctrl.sent("POST")[0].body["network"] == {
        "public_egress": False, "allow_out": ["198.18.0.10/32"],
        "deny_out": ["0.0.0.0/0", "::/0"], "egress": "corp", "resolver": "dns"}


def test_workspace_create_without_flags_sends_no_policy(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/workspaces", ok(ws(state="CREATING")))
    assert kibo("workspace", "create", "--template", "base", "--no-wait").exit_code == 0
    assert "network" not in fake_ctrl.sent("POST")[0].body


@pytest.mark.parametrize("args", [
    ["--allow-out", "10.0.0.1/8"], ["--deny-out", "example.org"], ["--egress", "Corp"],
    ["--resolver", "-dns"], ["--deny-out", "10.0.0.0/33"],
])
def test_bad_policy_flags_send_nothing(kibo, fake_ctrl, args):
    result = kibo("workspace", "create", "--template", "base", *args)
    assert result.exit_code == 10, result.output
    result = kibo("workspace", "set-network", WS, *args)
    assert result.exit_code == 10, result.output
    assert fake_ctrl.requests == []


def test_set_network_replaces_the_whole_policy(kibo, fake_ctrl):
    policy = {"public_egress": True, "allow_out": [], "deny_out": ["10.0.0.0/8"],
              "egress": None, "resolver": None}
    fake_ctrl.route("POST", f"/v1/workspaces/{WS}/set-network", ok(
        ws(revision=6, network={"policy": policy, "revision": 2})))
    result = kibo("workspace", "set-network", WS, "--deny-out", "10.0.0.0/8",
                  "--expected-version", "5", "--command-id", "sn-1")
    assert result.exit_code == 0, result.stderr
    assert fake_ctrl.sent("POST")[0].body == {
        "network": policy, "expected_version": 5, "command_id": "sn-1"}
    assert result.stdout == (f"workspace {WS} AVAILABLE on node node-a (revision 6); "
                             "network policy revision 2: public egress on; deny "
                             "10.0.0.0/8\n")
    # No flag: the explicit policy of the defaults; --default: the deployment default.
    kibo("workspace", "set-network", WS)
    assert fake_ctrl.sent("POST")[-1].body["network"] == {
        "public_egress": True, "allow_out": [], "deny_out": [], "egress": None,
        "resolver": None}
    kibo("workspace", "set-network", WS, "--default")
    assert "network" not in fake_ctrl.sent("POST")[-1].body
    result = kibo("workspace", "set-network", WS, "--default", "--no-public-egress")
    assert result.exit_code == 2
    help_text = kibo("workspace", "set-network", "--help").stdout
    assert "WHOLE network policy" in help_text
    assert "not kept" in help_text


def test_get_shows_the_policy_and_the_guest_addresses(kibo, fake_ctrl):
    applied = {"public_egress": False, "allow_out": ["198.18.0.10/32"],
               "deny_out": ["0.0.0.0/0"],
               "egress": {"name": "corp", "revision": 2, "address": "p:1080",
                          "authenticated": True}, "resolver": None}
    record = ws(network={"policy": {**applied, "egress": "corp"}, "revision": 3})
    record["instance"].update(network=applied, network_revision=3,
                              addresses=["10.200.0.3/31", "fd00::3/127"])
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}", ok(record))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/location", ok(
        {"workspace_id": WS, "node_id": "node-a", "instance_id": INST}))
    result = kibo("workspace", "get", WS)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "Network" in lines
    assert "  Policy:          public egress off; allow 198.18.0.10/32; deny 0.0.0.0/0; " \
           "egress corp" in lines
    assert "  Revision:        3" in lines
    assert "  In force:        public egress off; allow 198.18.0.10/32; deny 0.0.0.0/0; " \
           "egress corp (revision 2)" in lines
    assert "  Guest addresses: 10.200.0.3/31, fd00::3/127" in lines
    result = kibo("workspace", "get", WS, "--json")
    assert json.loads(result.stdout)["result"]["instance"]["addresses"] == [
        "10.200.0.3/31", "fd00::3/127"]


def test_get_of_a_default_workspace_without_network(kibo, fake_ctrl):
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}", ok(ws()))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/location", ok(
        {"workspace_id": WS, "node_id": "node-a", "instance_id": INST}))
    lines = kibo("workspace", "get", WS).stdout.splitlines()
    assert "  Policy:          default (the network the node provides)" in lines
    assert "  In force:        none (started without a network)" in lines
    assert "  Guest addresses: -" in lines


# ------------------------------------------------------------------------ docs


def test_every_network_command_and_option_is_documented():
    ctx = click.Context(kibo_cli)
    for group_name in ("egress", "resolver"):
        group = kibo_cli.get_command(ctx, group_name)
        assert isinstance(group, click.Group)
        names = group.list_commands(click.Context(group))
        assert names
        for name in names:
            assert f"kibo {group_name} {name}" in DOC, name
            cmd = group.get_command(click.Context(group), name)
            assert cmd is not None
            for param in cmd.params:
                if isinstance(param, click.Option) and not param.hidden:
                    assert max(param.opts, key=len) in DOC, (group_name, name, param.opts)
    assert "kibo workspace set-network" in DOC
    for flag in ("--allow-out", "--deny-out", "--no-public-egress", "--egress", "--resolver",
                 "--default"):
        assert flag in DOC, flag
