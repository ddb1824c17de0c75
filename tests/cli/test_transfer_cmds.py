"""``kibo transfer export|import`` against the recording fake ctrl: what is sent
(nothing on bad input), rendering, JSON, and docs/cli.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest

from kibotos.cli.main import kibo_cli

VOL = "vol-01k6aaaaaaaaaaaaaaaaaaaaaa"
NEW = "vol-01k6bbbbbbbbbbbbbbbbbbbbbb"
DIGEST = "sha256:" + "ab" * 32
MIB = 1 << 20
DOC = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()


def ok(value: Any) -> tuple[int, Any]:
    return 200, {"result": value}


EXPORTED = {"volume_id": VOL, "pool_id": "node-a-local", "node_id": "node-a", "epoch": 3,
            "artifact_digest": DIGEST, "size": 3 * MIB // 2, "capacity_bytes": 64 * MIB}


def imported() -> dict[str, Any]:
    volume = {"volume_id": NEW, "pool_id": "shared", "capacity_bytes": 64 * MIB,
              "state": "AVAILABLE", "reason": None, "labels": {"from": "a"},
              "workspace_id": None, "mount_point": None, "holder_node_id": None,
              "epoch": 1, "operation": None, "revision": 2,
              "created_at": "2026-11-29T15:00:00.000Z",
              "updated_at": "2026-11-29T15:00:00.000Z", "deleted_at": None}
    return {"volume": volume, "artifact_digest": DIGEST, "node_id": "node-b",
            "source_volume_id": VOL}


def test_export_sends_the_volume_and_prints_the_digest(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/transfers/export", ok(EXPORTED))
    result = kibo("transfer", "export", VOL, "--command-id", "t-1")
    assert result.exit_code == 0, result.stderr
    assert fake_ctrl.sent("POST")[0].body == {"volume_id": VOL, "command_id": "t-1"}
    assert DIGEST in result.stdout
    assert "1.5MiB" in result.stdout
    assert "node node-a at epoch 3" in result.stdout


def test_import_sends_pool_and_labels_and_prints_the_volume(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/transfers/import", ok(imported()))
    result = kibo("transfer", "import", "ab" * 32, "--pool", "shared", "--label", "from=a")
    assert result.exit_code == 0, result.stderr
    body = fake_ctrl.sent("POST")[0].body
    assert body["artifact_digest"] == DIGEST  # bare hex accepted, sent canonical
    assert (body["pool_id"], body["labels"]) == ("shared", {"from": "a"})
    assert body["command_id"]  # one is generated, so a retry of this call replays
    assert result.stdout.startswith(f"volume {NEW} AVAILABLE in pool shared, 64.0MiB")
    assert f"imported from {DIGEST} (volume {VOL}) by node node-b" in result.stdout


def test_json_output_is_the_result(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/transfers/export", ok(EXPORTED))
    result = kibo("transfer", "export", VOL, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout) == {"result": EXPORTED}


def test_refusal_exit_codes(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/transfers/export", (412, {"error": {
        "code": "failed_precondition", "message": "workspace ws-1 is AVAILABLE"}}))
    result = kibo("transfer", "export", VOL)
    assert result.exit_code == 13
    assert "workspace ws-1 is AVAILABLE" in result.stderr


@pytest.mark.parametrize("args", [
    ["export", "Vol-X"], ["export", "../x"], ["import", "zz"],
    ["import", DIGEST, "--pool", "Bad_Pool"], ["import", DIGEST, "--label", "x"],
    ["export", VOL, "--command-id", "bad id"],
])
def test_bad_input_sends_nothing(kibo, fake_ctrl, args):
    result = kibo("transfer", *args)
    assert result.exit_code == 10, result.output
    assert fake_ctrl.requests == []


def test_every_transfer_command_and_option_is_documented():
    group = kibo_cli.get_command(click.Context(kibo_cli), "transfer")
    assert isinstance(group, click.Group)
    ctx = click.Context(group)
    names = group.list_commands(ctx)
    assert set(names) == {"export", "import"}
    for name in names:
        cmd = group.get_command(ctx, name)
        assert cmd is not None
        assert f"kibo transfer {name}" in DOC, name
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert max(param.opts, key=len) in DOC, f"kibo transfer {name} {param.opts}"
