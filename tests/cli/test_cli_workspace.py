"""``kibo workspace`` against the recording fake ctrl: what is sent (and that nothing is
sent on bad input), waiting and its exit codes, the two-step location listing, the
Node line (``-``, ``unknown``), move's steps and command IDs, and docs/cli.md."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import click
import pytest

from kibotos.cli.main import kibo_cli

WS = "ws-01k6aaaaaaaaaaaaaaaaaaaaaa"
INST = "inst-01k6bbbbbbbbbbbbbbbbbbbbbb"
DOC = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()


def ws(state: str = "AVAILABLE", **changes: Any) -> dict[str, Any]:
    executing = state in ("CREATING", "STARTING", "AVAILABLE", "STOPPING")
    out: dict[str, Any] = {
        "workspace_id": WS,
        "template": {"name": "base", "image_digest": "sha256:" + "a" * 64,
                     "kernel_digest": "sha256:" + "b" * 64,
                     "initramfs_digest": "sha256:" + "c" * 64},
        "labels": {"team": "ml"}, "state": state, "reason": None, "revision": 4,
        "resources": {"cpu_millis": 1500, "memory_bytes": 2 << 30},
        "layer": {"pool_id": "node-a-local", "ref": "lay-x", "size_bytes": 10 << 30},
        "node_id": "node-a" if executing else None,
        "instance_id": INST if executing else None,
        "last_node_id": "node-a", "last_instance_id": INST,
        "created_at": "2026-11-29T15:00:00.000Z", "updated_at": "2026-11-29T15:01:00.000Z",
        "deleted_at": None,
        "instance": {"instance_id": INST, "node_id": "node-a", "state": "RUNNING",
                     "reason": None, "guest": {"boot_id": "b-1", "capabilities": []},
                     "confirmed_on_disk": None},
    }
    out.update(changes)
    return out


def ok(value: Any) -> tuple[int, Any]:
    return 200, {"result": value}


def err(status: int, code: str, message: str, **details: Any) -> tuple[int, Any]:
    body: dict[str, Any] = {"code": code, "message": message}
    if details:
        body["details"] = details
    return status, {"error": body}


# ------------------------------------------------------------------------ create


def test_create_sends_the_body_and_waits_until_available(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/workspaces", ok(ws("CREATING")))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}", ok(ws("CREATING")), ok(ws()))
    result = kibo("workspace", "create", "--template", "base", "--label", "team=ml",
                  "--label", "tier=gold", "--node", "node-a", "--cpu", "1.5", "--memory",
                  "2G", "--layer-size", "20G", "--command-id", "c-1")
    assert result.exit_code == 0, result.stderr
    body = fake_ctrl.sent("POST")[0].body
    assert body == {"template": "base", "labels": {"team": "ml", "tier": "gold"},
                    "node_id": "node-a", "cpu_millis": 1500, "memory_bytes": 2 << 30,
                    "layer_size_bytes": 20 << 30, "command_id": "c-1"}
    gets = fake_ctrl.sent("GET")
    assert len(gets) == 2
    assert float(gets[0].query["wait_s"]) > 0
    assert result.stdout == f"workspace {WS} AVAILABLE on node node-a (revision 4)\n"
    assert f"waiting for workspace {WS} (CREATING)" in result.stderr


def test_create_no_wait_returns_at_once(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/workspaces", ok(ws("CREATING")))
    result = kibo("workspace", "create", "--template", "base", "--no-wait", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["result"]["state"] == "CREATING"
    assert fake_ctrl.sent("GET") == []
    assert fake_ctrl.sent("POST")[0].body["command_id"].startswith("kibo-")


def test_create_that_fails_is_13(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/workspaces", ok(ws("CREATING")))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}",
                    ok(ws("FAILED", reason="the guest did not answer")))
    result = kibo("workspace", "create", "--template", "base")
    assert result.exit_code == 13
    assert "is FAILED after the create: the guest did not answer" in result.stderr


def test_wait_ends_with_the_global_timeout(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/workspaces", ok(ws("CREATING")))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}", ok(ws("CREATING")))
    result = kibo("workspace", "create", "--template", "base", "--timeout", "1s")
    assert result.exit_code == 16
    assert "still CREATING after the global --timeout of 1s" in result.stderr
    assert len(fake_ctrl.sent("POST")) == 1


@pytest.mark.parametrize(("args", "code"), [
    (["--cpu", "0"], 10), (["--cpu", "1.0001"], 10), (["--cpu", "lots"], 10),
    (["--memory", "lots"], 10), (["--node", "Node_A"], 10), (["--label", "team"], 10),
    (["--label", "Bad=x"], 10), (["--label", "a=1", "--label", "a=2"], 2),
    (["--command-id", "-bad"], 10),
])
def test_bad_create_input_sends_nothing(kibo, fake_ctrl, args, code):
    result = kibo("workspace", "create", "--template", "base", *args)
    assert result.exit_code == code, result.output
    assert fake_ctrl.requests == []


def test_resource_exhausted_is_15(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/workspaces",
                    err(429, "resource_exhausted", "no node can take a Workspace"))
    assert kibo("workspace", "create", "--template", "base").exit_code == 15


# ------------------------------------------------------------------------ stop, start


def test_stop_force_waits_and_says_not_confirmed(kibo, fake_ctrl):
    stopped = ws("STOPPED", instance={**ws()["instance"], "state": "STOPPED",
                                      "confirmed_on_disk": False})
    fake_ctrl.route("POST", f"/v1/workspaces/{WS}/stop", ok(ws("STOPPING")))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}", ok(stopped))
    result = kibo("workspace", "stop", WS, "--force", "--expected-version", "4")
    assert result.exit_code == 0, result.stderr
    assert fake_ctrl.sent("POST")[0].body["force"] is True
    assert fake_ctrl.sent("POST")[0].body["expected_version"] == 4
    assert result.stdout.endswith("; confirmed on disk: no\n")


def test_start_pinned(kibo, fake_ctrl):
    fake_ctrl.route("POST", f"/v1/workspaces/{WS}/start", ok(ws("STARTING")))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}", ok(ws()))
    result = kibo("workspace", "start", WS, "--node", "node-b")
    assert result.exit_code == 0
    assert fake_ctrl.sent("POST")[0].body["node_id"] == "node-b"


def test_bad_workspace_id_sends_nothing(kibo, fake_ctrl):
    for verb in ("start", "stop", "delete", "get", "cleanup-status"):
        assert kibo("workspace", verb, "WS_1").exit_code == 10
    assert fake_ctrl.requests == []


# ------------------------------------------------------------------------ get, list


def test_get_node_line(kibo, fake_ctrl):
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}", ok(ws()))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/location",
                    ok({"workspace_id": WS, "node_id": "node-a", "instance_id": INST}))
    out = kibo("workspace", "get", WS).stdout
    assert re.search(r"^  Node: +node-a$", out, re.M)
    assert "Instance:" not in out
    wide = kibo("workspace", "get", WS, "--wide").stdout
    assert re.search(rf"^  Instance: +{INST}$", wide, re.M)


def test_get_not_executing_shows_dash(kibo, fake_ctrl):
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}", ok(ws("STOPPED")))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/location",
                    ok({"workspace_id": WS, "node_id": None, "instance_id": None}))
    out = kibo("workspace", "get", WS, "--wide").stdout
    assert re.search(r"^  Node: +-$", out, re.M)
    assert re.search(r"^  Instance: +-$", out, re.M)


def test_get_against_an_older_ctrl_says_unknown(kibo, fake_ctrl):
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}", ok(ws()))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/location",
                    err(404, "not_found", f"no such API route: GET /v1/workspaces/{WS}/location"))
    result = kibo("workspace", "get", WS)
    assert result.exit_code == 0
    assert re.search(r"^  Node: +unknown$", result.stdout, re.M)


def test_list_by_node_reads_locations_then_each_workspace(kibo, fake_ctrl):
    gone = "ws-01k6cccccccccccccccccccccc"
    fake_ctrl.route("GET", "/v1/workspace-locations", ok({
        "locations": [{"workspace_id": WS, "node_id": "node-a", "instance_id": INST},
                      {"workspace_id": gone, "node_id": "node-a", "instance_id": "inst-z"}],
        "next_page_token": None}))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}", ok(ws()))
    fake_ctrl.route("GET", f"/v1/workspaces/{gone}",
                    err(404, "not_found", f"workspace {gone} does not exist"))
    result = kibo("workspace", "list", "--node", "node-a", "--wide")
    assert result.exit_code == 0, result.stderr
    assert fake_ctrl.sent("GET", "/v1/workspace-locations")[0].query["node_id"] == "node-a"
    rows = [line for line in result.stdout.splitlines() if line.startswith("|")]
    assert len(rows) == 2  # header and the one that still exists
    assert rows[0].split("|")[1:-1] == [f" {c} " for c in (
        "WORKSPACE".ljust(len(WS)), "STATE    ", "TEMPLATE", "CPU", "MEMORY",
        "LABELS ", "INSTANCE".ljust(len(INST)), "NODE  ")]
    assert INST in rows[1]
    assert "node-a" in rows[1]
    quiet = kibo("workspace", "list", "--instance", INST, "-q", "--all")
    assert quiet.stdout == f"{WS}\n"


def test_list_node_unknown_is_12(kibo, fake_ctrl):
    fake_ctrl.route("GET", "/v1/workspace-locations",
                    err(404, "not_found", "node node-x does not exist"))
    assert kibo("workspace", "list", "--node", "node-x").exit_code == 12


@pytest.mark.parametrize("args", [
    ["--node", "node-a", "--instance", INST], ["--node", "node-a", "--state", "AVAILABLE"],
    ["--instance", INST, "--label", "a=b"]])
def test_list_location_flags_are_exclusive(kibo, fake_ctrl, args):
    assert kibo("workspace", "list", *args).exit_code == 2
    assert fake_ctrl.requests == []


def test_list_filters_are_sent(kibo, fake_ctrl):
    fake_ctrl.route("GET", "/v1/workspaces", ok({"workspaces": [ws()],
                                                 "next_page_token": "t1"}),
                    ok({"workspaces": [ws("STOPPED")], "next_page_token": None}))
    result = kibo("workspace", "list", "--state", "available", "--state", "STOPPED",
                  "--label", "team=ml", "--all", "--json")
    assert result.exit_code == 0
    sent = fake_ctrl.sent("GET", "/v1/workspaces")
    assert sent[0].query == {"state": "AVAILABLE,STOPPED", "label": "team=ml",
                             "page_size": "100"}
    assert sent[1].query["page_token"] == "t1"
    assert len(json.loads(result.stdout)["result"]["workspaces"]) == 2


# ------------------------------------------------------------------------ move


def check(state: str = "AVAILABLE", already: bool = False) -> tuple[int, Any]:
    return ok({"workspace": ws(state), "node_id": "node-b", "already_there": already,
               "objects": [], "node_pools": ["shared-1"]})


def test_move_checks_stops_and_starts_with_derived_command_ids(kibo, fake_ctrl):
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/move-check", check())
    fake_ctrl.route("POST", f"/v1/workspaces/{WS}/stop", ok(ws("STOPPING")))
    fake_ctrl.route("POST", f"/v1/workspaces/{WS}/start",
                    ok(ws("STARTING", node_id="node-b")))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}", ok(ws("STOPPED")),
                    ok(ws(node_id="node-b")))
    result = kibo("workspace", "move", WS, "--node", "node-b", "--command-id", "mv-1")
    assert result.exit_code == 0, result.stderr
    posts = fake_ctrl.sent("POST")
    assert [(p.path.rsplit("/", 1)[1], p.body) for p in posts] == [
        ("stop", {"command_id": "mv-1/stop"}),
        ("start", {"node_id": "node-b", "command_id": "mv-1/start"})]
    assert result.stdout.startswith(f"moved workspace {WS} to node node-b")


def test_move_of_a_stopped_workspace_only_starts(kibo, fake_ctrl):
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/move-check", check("STOPPED"))
    fake_ctrl.route("POST", f"/v1/workspaces/{WS}/start", ok(ws("STARTING")))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}", ok(ws(node_id="node-b")))
    assert kibo("workspace", "move", WS, "--node", "node-b").exit_code == 0
    assert [p.path.rsplit("/", 1)[1] for p in fake_ctrl.sent("POST")] == ["start"]


def test_move_already_there_succeeds_without_stopping(kibo, fake_ctrl):
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/move-check", check(already=True))
    result = kibo("workspace", "move", WS, "--node", "node-b")
    assert result.exit_code == 0
    assert result.stdout == f"workspace {WS} already runs on node node-b\n"
    assert fake_ctrl.sent("POST") == []


def test_move_check_failure_changes_nothing(kibo, fake_ctrl):
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/move-check",
                    err(412, "failed_precondition", "retained layer lay-x of workspace is in "
                        "pool node-a-local, which node node-b is not attached to"))
    result = kibo("workspace", "move", WS, "--node", "node-b")
    assert result.exit_code == 13
    assert fake_ctrl.sent("POST") == []


def test_move_stop_failure_exits_with_its_error(kibo, fake_ctrl):
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/move-check", check())
    fake_ctrl.route("POST", f"/v1/workspaces/{WS}/stop", ok(ws("STOPPING")))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}", ok(ws("FAILED", reason="stop failed")))
    result = kibo("workspace", "move", WS, "--node", "node-b")
    assert result.exit_code == 13
    assert "FAILED after the stop: stop failed" in result.stderr
    assert [p.path.rsplit("/", 1)[1] for p in fake_ctrl.sent("POST")] == ["stop"]


def test_move_start_failure_says_how_to_start_again(kibo, fake_ctrl):
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/move-check", check("STOPPED"))
    fake_ctrl.route("POST", f"/v1/workspaces/{WS}/start",
                    err(429, "resource_exhausted", "node node-b cannot take this Workspace"))
    result = kibo("workspace", "move", WS, "--node", "node-b", "--json")
    assert result.exit_code == 15
    assert f"start it again with `kibo workspace start {WS} --node node-b`" in result.stderr
    body = json.loads(result.stdout)
    assert body["error"]["details"]["retry"] == f"kibo workspace start {WS} --node node-b"


# ------------------------------------------------------------------------ docs


def test_every_workspace_command_and_option_is_documented():
    group = kibo_cli.get_command(click.Context(kibo_cli), "workspace")
    assert isinstance(group, click.Group)
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None
        assert f"kibo workspace {name}" in DOC, name
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden:
                flag = max(param.opts, key=len)
                assert flag in DOC, f"kibo workspace {name} {flag}"


def test_cleanup_status_table(kibo, fake_ctrl):
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/cleanup-status", ok({
        "workspace_id": WS, "instance_id": INST, "node_id": "node-a",
        "items": [{"item": i, "status": "RELEASED", "source": "control_plane",
                   "observed_at": "2026-11-29T15:01:00.000Z"}
                  for i in ("RUNTIME", "VOLUME_ATTACHMENT", "RESIDUAL")]}))
    out = kibo("workspace", "cleanup-status", WS).stdout
    assert out.startswith(f"workspace {WS}: Instance {INST} on node node-a\n")
    assert re.search(r"\| VOLUME_ATTACHMENT \| RELEASED \| control_plane \|", out)
