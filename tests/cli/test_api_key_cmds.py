"""``kibo api-key create|list|revoke`` against the recording fake ctrl: what is sent,
nothing on bad input, the key alone on stdout (shown once), and docs/gateways.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

KEY_ID = "kak-01k6aaaaaaaaaaaaaaaaaaaaaa"
STAMP = "2026-12-02T00:00:00.000Z"
DOC = (Path(__file__).parents[2] / "docs" / "gateways.md").read_text()


def record(**changes: Any) -> dict[str, Any]:
    out = {"key_id": KEY_ID, "name": "ci", "team": "blue", "state": "active",
           "created_at": STAMP, "created_by": "kid-x", "revoked_at": None}
    out.update(changes)
    return out


def test_create_prints_the_key_alone_on_stdout(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/api-keys", (200, {"result": {
        **record(), "key": f"{KEY_ID}.s3cret"}}))
    result = kibo("api-key", "create", "ci", "--team", "blue", "--command-id", "k-1")
    assert result.exit_code == 0, result.stderr
    assert fake_ctrl.sent("POST")[0].body == {"name": "ci", "team": "blue",
                                              "command_id": "k-1"}
    assert result.stdout == f"{KEY_ID}.s3cret\n"
    assert "not shown again" in result.stderr


def test_list_and_revoke(kibo, fake_ctrl):
    fake_ctrl.route("GET", "/v1/api-keys", (200, {"result": {"api_keys": [record()]}}))
    listed = kibo("api-key", "list")
    assert listed.exit_code == 0, listed.stderr
    assert KEY_ID in listed.stdout
    assert "blue" in listed.stdout
    fake_ctrl.route("POST", f"/v1/api-keys/{KEY_ID}/revoke", (200, {"result": record(
        state="revoked", revoked_at=STAMP)}))
    revoked = kibo("api-key", "revoke", KEY_ID)
    assert revoked.exit_code == 0, revoked.stderr
    assert revoked.stdout == f"API key {KEY_ID} revoked at {STAMP}\n"


@pytest.mark.parametrize("args", [["create", "CI"], ["create", "ci", "--team", "Blue"],
                                  ["revoke", "kak/../x"]])
def test_bad_input_sends_nothing(kibo, fake_ctrl, args):
    result = kibo("api-key", *args)
    assert result.exit_code == 10, result.output
    assert fake_ctrl.requests == []


def test_the_commands_are_documented():
    for words in ("kibo api-key create", "kibo api-key list", "kibo api-key revoke",
                  "--team"):
        assert words in DOC, words
