"""Strings from the server never act on the operator's terminal (issue 16): a node's
``release_version`` with an ESC sequence, a grant ``name`` with a newline that would
make a fake table row, an error message with a carriage return.  Tables, sections,
lines and errors show them escaped (``\\x1b``); ``--json`` keeps the exact string.

The answers come from `cli_fakectrl` (an HTTP server on loopback) because records with
such strings are what ctrl stored before it refused them at input, and what a hostile
or broken ctrl may send."""

from __future__ import annotations

import json

import pytest
from cli_nodes import node

from kibotos.cli.core.output import printable

ESC = "\x1b[2J\x1b[31mred"
FAKE_ROW = "evil\n| kgr-fake | operator | - | - | pending"


def _grants(name: str) -> dict[str, object]:
    return {
        "grants": [{"grant_id": "kgr-01k6grantgrantgrantgrantgr", "kind": "operator",
                    "node_id": None, "name": name, "state": "pending",
                    "created_at": "2026-11-29T15:00:00.000Z", "created_by": None,
                    "expires_at": "2026-11-30T15:00:00.000Z", "used_at": None,
                    "identity_id": None, "revoked_at": None}],
        "identities": [],
    }


@pytest.mark.parametrize(("text", "shown"), [
    ("\x1b[31m", "\\x1b[31m"),
    ("a\nb\rc\td", "a\\x0ab\\x0dc\\x09d"),
    ("\x00\x7f\x9b", "\\x00\\x7f\\x9b"),
    ("line\u2028sep", "line\\u2028sep"),
    ("plain ünïcode, 漢字", "plain ünïcode, 漢字"),
])
def test_printable(text: str, shown: str) -> None:
    assert printable(text) == shown


def test_node_list_escapes_the_release_version(kibo, fake_ctrl):
    evil = node(latest_session={"release_version": ESC})
    fake_ctrl.route("GET", "/v1/nodes", (200, {"result": {"nodes": [evil],
                                                          "next_page_token": None}}))
    result = kibo("node", "list")
    assert result.exit_code == 0, result.stderr
    assert "\x1b" not in result.stdout
    assert "\\x1b[2J\\x1b[31mred" in result.stdout
    listing = json.loads(kibo("node", "list", "--json").stdout)
    assert listing["result"]["nodes"][0]["latest_session"]["release_version"] == ESC


def test_node_get_escapes_the_release_version(kibo, fake_ctrl):
    fake_ctrl.route("GET", "/v1/nodes/node-a",
                    (200, {"result": node(latest_session={"release_version": ESC})}))
    result = kibo("node", "get", "node-a", "--wide")
    assert result.exit_code == 0, result.stderr
    assert "\x1b" not in result.stdout
    assert "\\x1b[31mred" in result.stdout, result.stdout


def test_enrollment_list_shows_no_fake_row(kibo, fake_ctrl):
    fake_ctrl.route("GET", "/v1/enrollment/grants", (200, {"result": _grants(FAKE_ROW)}))
    result = kibo("enrollment", "list")
    assert result.exit_code == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| kgr-")]
    assert len(rows) == 1, result.stdout
    assert "evil\\x0a| kgr-fake" in rows[0]
    assert json.loads(kibo("enrollment", "list", "--json").stdout)["result"] == \
        _grants(FAKE_ROW)


def test_an_error_message_is_escaped(kibo, fake_ctrl):
    fake_ctrl.route("GET", "/v1/nodes/node-a", (404, {"error": {
        "code": "not_found", "message": "no node\r\x1b[2Kall good"}}))
    result = kibo("node", "get", "node-a")
    assert result.exit_code == 12
    assert "\x1b" not in result.stderr
    assert "\r" not in result.stderr
    assert "no node\\x0d\\x1b[2Kall good" in result.stderr
