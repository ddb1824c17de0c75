"""The client's boundary: wire errors to exit codes, transport failures, command IDs."""

from __future__ import annotations

import json
import socket
import time

import pytest
from cli_invoke import invoke
from cli_nodes import node

from kibotos.cli.core.client import Client
from kibotos.core.errors import ERROR_CLASSES, Unavailable


@pytest.mark.parametrize(("code", "status", "exit_code"), [
    ("invalid_argument", 400, 10), ("unauthenticated", 401, 11),
    ("permission_denied", 403, 11), ("not_found", 404, 12),
    ("failed_precondition", 412, 13), ("aborted", 409, 14), ("already_exists", 409, 14),
    ("resource_exhausted", 429, 15), ("deadline_exceeded", 504, 16),
    ("unavailable", 503, 17), ("internal", 500, 1),
])
def test_wire_errors_become_exit_codes(kibo, fake_ctrl, code, status, exit_code):
    assert ERROR_CLASSES[code].exit_code == exit_code
    fake_ctrl.route("POST", "/v1/nodes/node-a/drain",
                    (status, {"error": {"code": code, "message": f"it went {code}"}}))
    result = kibo("node", "drain", "node-a")
    assert result.exit_code == exit_code
    assert result.stderr == f"error: {code}: it went {code}\n"
    assert result.stdout == ""
    as_json = kibo("node", "drain", "node-a", "--json")
    assert json.loads(as_json.stdout) == {"error": {"code": code,
                                                    "message": f"it went {code}"}}


def test_non_json_error_maps_by_status(kibo, fake_ctrl):
    fake_ctrl.route("GET", "/v1/nodes/node-a", (404, "plain text"))
    result = kibo("node", "get", "node-a")
    assert result.exit_code == 12
    assert "HTTP 404" in result.stderr


def test_connection_refused_is_unavailable_naming_the_url(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "kibo.toml"
    path.write_text(f'ctrl_url = "http://127.0.0.1:{port}"\n')
    result = invoke(path, "node", "list")
    assert result.exit_code == 17
    assert f"error: unavailable: cannot reach ctrl at http://127.0.0.1:{port}" in result.stderr


def test_slow_ctrl_is_deadline_exceeded(kibo, fake_ctrl):
    def slow(rec):
        time.sleep(3)
        return 200, {"result": node()}

    fake_ctrl.route("GET", "/v1/nodes/node-a", slow)
    result = kibo("node", "get", "node-a", "--timeout", "300ms")
    assert result.exit_code == 16
    assert result.stderr.startswith("error: deadline_exceeded: ctrl at http://127.0.0.1:")


def test_every_write_carries_a_command_id(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/nodes/node-a/drain", (200, {"result": node()}))
    kibo("node", "drain", "node-a")
    kibo("node", "drain", "node-a")
    kibo("node", "drain", "node-a", "--command-id", "drain-a", "--expected-version", "7")
    bodies = [r.body for r in fake_ctrl.sent("POST")]
    generated = [b["command_id"] for b in bodies[:2]]
    assert all(c.startswith("kibo-") for c in generated)
    assert generated[0] != generated[1]
    assert bodies[2] == {"command_id": "drain-a", "expected_version": 7}
    assert fake_ctrl.sent()[0].headers["authorization"] == (
        "Bearer kid-01k6testtesttesttesttesttes:s3cret")


def test_a_retried_write_is_a_replay(fake_ctrl):
    # The first request reaches ctrl but its connection drops before the answer: the
    # retry must carry the same command ID, so ctrl replays instead of acting twice.
    fake_ctrl.drop_next = 1
    fake_ctrl.route("POST", "/v1/nodes/node-a/drain", (200, {"result": node()}))
    with Client(fake_ctrl.url, "kid-x:y") as client:
        assert client.post("/v1/nodes/node-a/drain", {})["node_id"] == "node-a"
    first, second = fake_ctrl.sent("POST")
    assert first.body["command_id"] == second.body["command_id"]


def test_transport_failures_give_up(fake_ctrl):
    fake_ctrl.drop_next = 10
    with Client(fake_ctrl.url, None) as client, pytest.raises(Unavailable) as err:
        client.get("/v1/nodes")
    assert fake_ctrl.url in err.value.message
    assert len(fake_ctrl.requests) == 3


def test_success_without_result_is_internal(kibo, fake_ctrl):
    fake_ctrl.route("GET", "/v1/nodes/node-a", (200, {"nodes": []}))
    result = kibo("node", "get", "node-a")
    assert result.exit_code == 1
    assert "no result" in result.stderr


def _refusing_url() -> str:
    """A loopback URL nothing listens on (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_several_ctrl_urls_move_on_at_a_connection_failure(tmp_path, fake_ctrl):
    dead = _refusing_url()
    fake_ctrl.route("GET", "/v1/nodes/node-a", (200, {"result": node()}))
    fake_ctrl.route("POST", "/v1/nodes/node-a/drain", (200, {"result": node()}))
    path = tmp_path / "kibo.toml"
    path.write_text(f'ctrl_url = ["{dead}", "{fake_ctrl.url}"]\n')
    result = invoke(path, "node", "get", "node-a")
    assert result.exit_code == 0, result.stderr
    # The write that reached the answering replica went there once, with the command
    # ID it would carry to any replica.
    with Client([dead, fake_ctrl.url], None) as client:
        client.post("/v1/nodes/node-a/drain", {"command_id": "drain-1"})
        assert client.base_url == fake_ctrl.url
        client.get("/v1/nodes/node-a")  # goes to the replica that answered last
    assert [r.body.get("command_id") for r in fake_ctrl.sent("POST")] == ["drain-1"]
    assert len(fake_ctrl.sent("GET")) == 2


def test_every_ctrl_url_failing_is_unavailable_naming_them(tmp_path):
    first, second = _refusing_url(), _refusing_url()
    path = tmp_path / "kibo.toml"
    path.write_text(f'ctrl_url = ["{first}", "{second}"]\n')
    result = invoke(path, "node", "list")
    assert result.exit_code == 17
    assert f"cannot reach ctrl at any of {first}, {second}" in result.stderr


@pytest.mark.parametrize("value", ["[]", "[1]", "7", '["https://a:1", 2]'])
def test_ctrl_url_must_be_a_string_or_a_list_of_them(tmp_path, value):
    path = tmp_path / "kibo.toml"
    path.write_text(f"ctrl_url = {value}\n")
    result = invoke(path, "node", "list")
    assert result.exit_code == 10
    assert "ctrl_url: Input should be a valid string or a non-empty list" in result.stderr
