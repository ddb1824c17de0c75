"""kibo enroll writes its config safely; kibo enrollment create/list/revoke."""

from __future__ import annotations

import base64
import json
import stat
import tomllib

from cli_invoke import invoke

EXCHANGE = "/v1/enrollment/exchange"
OPERATOR = {"identity_id": "kid-01k6operatoroperatoroper", "credential": "kid-01k6op:sekret",
            "kind": "operator", "node_id": None}


def enroll(fake_ctrl, path, *extra):
    return invoke(None, "enroll", "--ctrl-url", fake_ctrl.url + "/", "--grant", "kgr-1.abc",
                  "--config", str(path), *extra)


def test_enroll_writes_config_0600(tmp_path, fake_ctrl):
    fake_ctrl.route("POST", EXCHANGE, (200, {"result": OPERATOR}))
    path = tmp_path / "conf" / "kibo.toml"
    result = enroll(fake_ctrl, path)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"enrolled as {OPERATOR['identity_id']}; wrote {path}\n"
    assert "sekret" not in result.stdout + result.stderr
    assert tomllib.loads(path.read_text()) == {"ctrl_url": fake_ctrl.url,
                                               "credential": "kid-01k6op:sekret"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = path.with_suffix(".key")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert key.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    sent = fake_ctrl.sent()[0]
    assert sent.body["token"] == "kgr-1.abc"
    assert len(base64.b64decode(sent.body["public_key"])) == 32
    assert "authorization" not in sent.headers
    assert "command_id" not in sent.body
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_enroll_refuses_to_overwrite_without_force(tmp_path, fake_ctrl):
    fake_ctrl.route("POST", EXCHANGE, (200, {"result": OPERATOR}))
    path = tmp_path / "kibo.toml"
    path.write_text("old = 1\n")
    result = enroll(fake_ctrl, path)
    assert result.exit_code == 13
    assert "already exists: add --force" in result.stderr
    assert fake_ctrl.requests == []  # the grant was not spent
    assert path.read_text() == "old = 1\n"
    assert enroll(fake_ctrl, path, "--force").exit_code == 0
    assert "credential" in path.read_text()


def test_enroll_json_never_prints_the_credential(tmp_path, fake_ctrl):
    fake_ctrl.route("POST", EXCHANGE, (200, {"result": OPERATOR}))
    path = tmp_path / "kibo.toml"
    result = enroll(fake_ctrl, path, "--json")
    assert json.loads(result.stdout) == {"result": {
        "identity_id": OPERATOR["identity_id"], "kind": "operator", "node_id": None,
        "config": str(path)}}


def test_enroll_with_a_node_grant_writes_nothing(tmp_path, fake_ctrl):
    fake_ctrl.route("POST", EXCHANGE, (200, {"result": {**OPERATOR, "kind": "node",
                                                        "node_id": "node-a"}}))
    path = tmp_path / "kibo.toml"
    result = enroll(fake_ctrl, path)
    assert result.exit_code == 13
    assert "not an operator" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_enroll_refused_grant(tmp_path, fake_ctrl):
    fake_ctrl.route("POST", EXCHANGE, (401, {"error": {
        "code": "unauthenticated", "message": "grant already used"}}))
    path = tmp_path / "kibo.toml"
    result = enroll(fake_ctrl, path)
    assert result.exit_code == 11
    assert result.stderr == "error: unauthenticated: grant already used\n"
    assert not path.exists()


def test_enroll_bad_url_sends_nothing(tmp_path, fake_ctrl):
    result = invoke(None, "enroll", "--ctrl-url", "ctrl:7400", "--grant", "kgr-1.abc",
                    "--config", str(tmp_path / "kibo.toml"))
    assert result.exit_code == 10
    assert "invalid --ctrl-url" in result.stderr


GRANT = {"grant_id": "kgr-01k6grantgrantgrantgrantgr", "token": "kgr-01k6.s3cr3t",
         "kind": "node", "node_id": "node-a", "name": None,
         "expires_at": "2026-11-29T16:00:00.000Z"}


def test_enrollment_create(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/enrollment/grants", (200, {"result": GRANT}))
    result = kibo("enrollment", "create", "--kind", "node", "--node-id", "node-a",
                  "--expires", "1h30m", "--name", "rack 3")
    assert result.exit_code == 0
    assert result.stdout == "kgr-01k6.s3cr3t\n"
    assert "for node node-a, usable once until 2026-11-29T16:00:00.000Z" in result.stderr
    body = fake_ctrl.sent()[0].body
    body.pop("command_id")
    assert body == {"kind": "node", "node_id": "node-a", "name": "rack 3",
                    "expires_in_s": 5400.0}


def test_enrollment_list(kibo, fake_ctrl):
    listing = {
        "grants": [{"grant_id": GRANT["grant_id"], "kind": "node", "node_id": "node-a",
                    "name": None, "state": "used", "created_at": "2026-11-29T15:00:00.000Z",
                    "created_by": None, "expires_at": GRANT["expires_at"],
                    "used_at": "2026-11-29T15:10:00.000Z",
                    "identity_id": "kid-01k6nodenodenodenodenoden", "revoked_at": None}],
        "identities": [{"identity_id": "kid-01k6nodenodenodenodenoden", "kind": "node",
                        "node_id": "node-a", "name": None, "grant_id": GRANT["grant_id"],
                        "state": "active", "created_at": "2026-11-29T15:10:00.000Z",
                        "revoked_at": None}],
    }
    fake_ctrl.route("GET", "/v1/enrollment/grants", (200, {"result": listing}))
    result = kibo("enrollment", "list")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert "Grants" in lines[0]
    assert any(line.startswith(f"| {GRANT['grant_id']} | node | node-a | -    | used")
               for line in lines)
    assert any(line.startswith("| kid-01k6nodenodenodenodenoden | node | node-a | -    | "
                               "active") for line in lines)
    assert json.loads(kibo("enrollment", "list", "--json").stdout) == {"result": listing}


def test_enrollment_revoke(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/enrollment/revoke",
                    (200, {"result": {"revoked": ["kid-01k6a", "kgr-01k6b"]}}))
    result = kibo("enrollment", "revoke", "kid-01k6a", "--command-id", "rv-1")
    assert result.exit_code == 0
    assert result.stdout == "revoked kid-01k6a, kgr-01k6b\n"
    assert fake_ctrl.sent()[0].body == {"id": "kid-01k6a", "command_id": "rv-1"}
