"""``kibo volume`` and the Volume parts of ``kibo workspace`` (create --volume,
expand-layer, move-layer) against the recording fake ctrl: what is sent (nothing on bad
input), waiting and its exit codes, rendering, and docs/cli.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest

from kibotos.cli.main import kibo_cli

VOL = "vol-01k6aaaaaaaaaaaaaaaaaaaaaa"
WS = "ws-01k6aaaaaaaaaaaaaaaaaaaaaa"
GI = 1 << 30
DOC = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()


def vol(state: str = "AVAILABLE", **changes: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "volume_id": VOL, "pool_id": "node-a-local", "capacity_bytes": 10 * GI,
        "state": state, "reason": None, "labels": {"team": "ml"}, "workspace_id": None,
        "mount_point": None, "holder_node_id": "node-a", "epoch": 1, "operation": None,
        "revision": 2, "created_at": "2026-11-29T15:00:00.000Z",
        "updated_at": "2026-11-29T15:01:00.000Z", "deleted_at": None}
    out.update(changes)
    return out


def op(status: str = "running", **changes: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "op": "expand", "status": status, "pool_id": "node-a-local",
        "target_pool_id": None, "target_capacity_bytes": 20 * GI, "node_id": "node-a",
        "error": None, "started_at": "2026-11-29T15:02:00.000Z",
        "updated_at": "2026-11-29T15:02:00.000Z"}
    out.update(changes)
    return out


def ok(value: Any) -> tuple[int, Any]:
    return 200, {"result": value}


def err(status: int, code: str, message: str) -> tuple[int, Any]:
    return status, {"error": {"code": code, "message": message}}


def test_create_sends_the_body_and_waits(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/volumes", ok(vol("CREATING")))
    fake_ctrl.route("GET", f"/v1/volumes/{VOL}", ok(vol("CREATING")), ok(vol()))
    result = kibo("volume", "create", "--size", "10G", "--pool", "node-a-local",
                  "--label", "team=ml", "--command-id", "c-1")
    assert result.exit_code == 0, result.stderr
    assert fake_ctrl.sent("POST")[0].body == {
        "capacity_bytes": 10 * GI, "pool_id": "node-a-local", "labels": {"team": "ml"},
        "command_id": "c-1"}
    assert float(fake_ctrl.sent("GET")[0].query["wait_s"]) > 0
    assert result.stdout == (f"volume {VOL} AVAILABLE in pool node-a-local, 10.0GiB "
                             "(revision 2)\n")


def test_create_refused_by_the_node_is_13(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/volumes", ok(vol("CREATING")))
    fake_ctrl.route("GET", f"/v1/volumes/{VOL}", ok(vol("FAILED", reason="mkfs failed")))
    result = kibo("volume", "create", "--size", "1G")
    assert result.exit_code == 13
    assert "FAILED after the create: mkfs failed" in result.stderr


@pytest.mark.parametrize(("args", "code"), [
    (["create", "--size", "lots"], 10), (["create", "--size", "1G", "--pool", "Bad_Pool"], 10),
    (["create", "--size", "1G", "--label", "x"], 10), (["get", "Vol-X"], 10),
    (["delete", "../x"], 10), (["expand", "a" * 33, "--size", "2G"], 10),
    (["move", VOL, "--pool", "-bad"], 10), (["list", "--workspace", "WS"], 10),
])
def test_bad_input_sends_nothing(kibo, fake_ctrl, args, code):
    result = kibo("volume", *args)
    assert result.exit_code == code, result.output
    assert fake_ctrl.requests == []


def test_get_and_list_render(kibo, fake_ctrl):
    attached = vol(workspace_id=WS, mount_point="/data",
                   operation=op("failed", error="resize2fs timed out"))
    fake_ctrl.route("GET", f"/v1/volumes/{VOL}", ok(attached))
    out = kibo("volume", "get", VOL).stdout
    assert f"Volume {VOL}" in out
    assert "/data" in out
    assert "expand to 20.0GiB (failed): resize2fs timed out" in out
    fake_ctrl.route("GET", "/v1/volumes", ok({"volumes": [attached],
                                              "next_page_token": None}))
    out = kibo("volume", "list", "--pool", "node-a-local").stdout
    assert "| MOUNT POINT" in out
    assert WS in out
    assert fake_ctrl.sent("GET", "/v1/volumes")[0].query["pool_id"] == "node-a-local"
    assert kibo("volume", "list", "-q").stdout == f"{VOL}\n"
    listed = json.loads(kibo("volume", "list", "--json").stdout)["result"]
    assert listed["volumes"][0]["volume_id"] == VOL


def test_expand_follows_the_operation(kibo, fake_ctrl):
    fake_ctrl.route("POST", f"/v1/volumes/{VOL}/expand", ok(vol(operation=op())))
    fake_ctrl.route("GET", f"/v1/volumes/{VOL}", ok(vol(operation=op())),
                    ok(vol(capacity_bytes=20 * GI, revision=3)))
    result = kibo("volume", "expand", VOL, "--size", "20G", "--expected-version", "2")
    assert result.exit_code == 0, result.stderr
    assert fake_ctrl.sent("POST")[0].body["capacity_bytes"] == 20 * GI
    assert fake_ctrl.sent("POST")[0].body["expected_version"] == 2
    assert "waiting for volume" in result.stderr
    assert "20.0GiB" in result.stdout


def test_failed_expansion_is_13_and_timeout_16(kibo, fake_ctrl):
    fake_ctrl.route("POST", f"/v1/volumes/{VOL}/expand", ok(vol(operation=op())))
    fake_ctrl.route("GET", f"/v1/volumes/{VOL}",
                    ok(vol(operation=op("failed", error="e2fsck: cannot check"))))
    result = kibo("volume", "expand", VOL, "--size", "20G")
    assert result.exit_code == 13
    assert "the expand of volume" in result.stderr
    assert "e2fsck: cannot check" in result.stderr
    fake_ctrl.route("GET", f"/v1/volumes/{VOL}", ok(vol(operation=op())))
    result = kibo("volume", "expand", VOL, "--size", "20G", "--timeout", "1s")
    assert result.exit_code == 16


def test_move_with_no_common_node_is_13(kibo, fake_ctrl):
    fake_ctrl.route("POST", f"/v1/volumes/{VOL}/move", err(
        409, "failed_precondition",
        "no node connects to both pools node-a-local and shared-a: mount ..."))
    result = kibo("volume", "move", VOL, "--pool", "shared-a")
    assert result.exit_code == 13
    assert "no node connects to both pools" in result.stderr


def test_delete_waits_when_asked(kibo, fake_ctrl):
    fake_ctrl.route("POST", f"/v1/volumes/{VOL}/delete", ok(vol("DELETING")))
    fake_ctrl.route("GET", f"/v1/volumes/{VOL}", ok(vol("DELETED")))
    assert kibo("volume", "delete", VOL).stdout.startswith(f"volume {VOL} DELETING")
    assert fake_ctrl.sent("GET") == []
    result = kibo("volume", "delete", VOL, "--wait")
    assert result.stdout.startswith(f"volume {VOL} DELETED")


def test_workspace_create_with_volumes(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/workspaces", err(409, "failed_precondition", "attached"))
    kibo("workspace", "create", "--template", "base", "--volume", f"{VOL}:/data",
         "--volume", "vol-b", "--no-wait")
    assert fake_ctrl.sent("POST")[0].body["volumes"] == [
        {"volume_id": VOL, "mount_point": "/data"}, {"volume_id": "vol-b"}]


@pytest.mark.parametrize(("item", "code"), [
    (f"{VOL}:data", 10), (f"{VOL}:/etc", 10), (f"{VOL}:/a/../b", 10), ("Vol-X", 10),
    (f"{VOL}:/a:b", 10),
])
def test_workspace_create_bad_volume_sends_nothing(kibo, fake_ctrl, item, code):
    result = kibo("workspace", "create", "--template", "base", "--volume", item)
    assert result.exit_code == code, result.output
    assert fake_ctrl.requests == []


def test_expand_layer_and_move_layer(kibo, fake_ctrl):
    status = {"workspace_id": WS, "state": "STOPPED", "revision": 5,
              "pool_id": "node-a-local", "ref": "lay-x", "size_bytes": 10 * GI,
              "operation": op()}
    fake_ctrl.route("POST", f"/v1/workspaces/{WS}/expand-layer", ok(status))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/layer", ok(status),
                    ok({**status, "size_bytes": 20 * GI, "operation": None}))
    result = kibo("workspace", "expand-layer", WS, "--size", "20G")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"workspace {WS}: writable layer 20.0GiB in pool node-a-local\n"
    fake_ctrl.route("POST", f"/v1/workspaces/{WS}/move-layer", ok(
        {**status, "operation": op("running", op="move", target_pool_id="shared-a")}))
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/layer", ok(
        {**status, "pool_id": "shared-a", "operation": None}))
    result = kibo("workspace", "move-layer", WS, "--pool", "shared-a")
    assert result.exit_code == 0, result.stderr
    assert "in pool shared-a" in result.stdout
    assert fake_ctrl.sent("POST", f"/v1/workspaces/{WS}/move-layer")[0].body["pool_id"] \
        == "shared-a"


def test_every_volume_command_and_option_is_documented():
    group = kibo_cli.get_command(click.Context(kibo_cli), "volume")
    assert isinstance(group, click.Group)
    ctx = click.Context(group)
    names = group.list_commands(ctx)
    assert set(names) == {"create", "get", "list", "expand", "move", "delete"}
    for name in names:
        cmd = group.get_command(ctx, name)
        assert cmd is not None
        assert f"kibo volume {name}" in DOC, name
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert max(param.opts, key=len) in DOC, f"kibo volume {name} {param.opts}"
