"""Strict request fields (issue 16, "Coercion", "Unbounded integers", "Numbers",
"Control characters"): against hypercorn on 127.0.0.1:0 (``running_ctrl``), every one
is ``invalid_argument`` naming the field, and nothing is written.

On main these were read laxly: ``"cpu_millis": true`` made a 0.001-CPU Workspace,
``"expected_version": "1"`` was 1, a capacity sent as a string was taken, a grant name
could hold ESC and newlines, and a query's ``page_size=1_0`` was 10."""

from __future__ import annotations

from typing import Any

import pytest
from ctrl_helpers import RunningCtrl, error, result

from kibotos.ctrl.model.session_store import MAX_INCARNATION_JUMP

BODIES = [
    ("POST", "/v1/workspaces", {"template": "base", "cpu_millis": True}, "cpu_millis"),
    ("POST", "/v1/workspaces", {"template": "base", "cpu_millis": "1000"}, "cpu_millis"),
    # A whole number is an integer however spelt (4224.0: JSON Schema's reading), and a
    # fraction is not.
    ("POST", "/v1/workspaces", {"template": "base", "memory_bytes": (1 << 30) + 0.5},
     "memory_bytes"),
    ("POST", "/v1/nodes/node-a/drain", {"expected_version": 1.5}, "expected_version"),
    ("POST", "/v1/workspaces", {"template": "base", "layer_size_bytes": 2**70},
     "layer_size_bytes"),
    ("POST", "/v1/workspaces", {"template": "base", "labels": {"a": 1}}, "labels"),
    ("POST", "/v1/nodes/node-a/drain", {"expected_version": True}, "expected_version"),
    ("POST", "/v1/nodes/node-a/drain", {"expected_version": "1"}, "expected_version"),
    ("POST", "/v1/nodes/node-a/drain", {"expected_version": 2**63}, "expected_version"),
    ("POST", "/v1/nodes/node-a/isolate", {"confirm_host_cannot_write": "true"},
     "confirm_host_cannot_write"),
    ("POST", "/v1/volumes", {"capacity_bytes": str(1 << 30)}, "capacity_bytes"),
    ("POST", "/v1/storage-pools/pool-a/set-capacity", {"capacity_bytes": "1099511627776"},
     "capacity_bytes"),
    ("POST", "/v1/enrollment/grants", {"kind": "operator", "name": "a\x1b[2Jb"}, "name"),
    ("POST", "/v1/enrollment/grants", {"kind": "operator", "name": "a\n| fake | row"},
     "name"),
    ("POST", "/v1/enrollment/grants", {"kind": "operator", "expires_in_s": "60"},
     "expires_in_s"),
    ("PUT", "/v1/overcommit/default", {"cpu": "1_0"}, "cpu"),
    ("PUT", "/v1/overcommit/default", {"cpu": "\u0663"}, "cpu"),
    ("PUT", "/v1/overcommit/default", {"cpu": 2}, "cpu"),
    ("POST", "/v1/workspaces/ws-1/stop", {"force": 1}, "force"),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), BODIES)
async def test_a_lax_body_field_is_refused(running_ctrl: RunningCtrl, method: str,
                                           path: str, body: dict[str, Any],
                                           field: str) -> None:
    before = result(await running_ctrl.http.get("/v1/enrollment/grants",
                                                headers=running_ctrl.operator))
    resp = await running_ctrl.http.request(method, path, json=body,
                                           headers=running_ctrl.operator)
    err = error(resp, "invalid_argument")
    assert field in err["message"], err
    assert result(await running_ctrl.http.get("/v1/enrollment/grants",
                                              headers=running_ctrl.operator)) == before


QUERIES = [
    ("/v1/nodes?page_size=1_0", "page_size"),
    ("/v1/nodes?page_size=%D9%A3", "page_size"),
    ("/v1/nodes?page_size=%205", "page_size"),
    ("/v1/nodes?page_size=%2B5", "page_size"),
    ("/v1/nodes?page_size=5.0", "page_size"),
    ("/v1/volumes?deleted=yes", "deleted"),
    ("/v1/volumes?deleted=1", "deleted"),
    ("/v1/workspaces/ws-1?wait_s=1_0", "wait_s"),
    ("/v1/workspaces/ws-1?wait_s=%2B1", "wait_s"),
    ("/v1/workspaces/ws-1?wait_s=1e999", "wait_s"),
    ("/v1/workspaces/ws-1?wait_s=nan", "wait_s"),
    ("/v1/nodes?page_token=%1B%5B2J", "page_token"),
]


@pytest.mark.parametrize(("path", "field"), QUERIES)
async def test_a_lax_query_parameter_is_refused(running_ctrl: RunningCtrl, path: str,
                                                field: str) -> None:
    resp = await running_ctrl.http.get(path, headers=running_ctrl.operator)
    err = error(resp, "invalid_argument")
    assert field in err["message"], err


async def test_real_queries_still_pass(running_ctrl: RunningCtrl) -> None:
    ops = running_ctrl.operator
    assert result(await running_ctrl.http.get("/v1/nodes?page_size=5", headers=ops)) == \
        {"nodes": [], "next_page_token": None}
    result(await running_ctrl.http.get("/v1/volumes?deleted=true", headers=ops))
    # Query numbers are JSON numbers (as clients format them: 1e-05), ASCII only.
    error(await running_ctrl.http.get("/v1/workspaces/ws-1?wait_s=1e-5", headers=ops),
          "not_found")


async def test_a_whole_number_spelt_with_a_fraction_is_an_integer(
        running_ctrl: RunningCtrl) -> None:
    """schemathesis' finding: ``"expected_version": 4224.0`` is an integer to JSON
    Schema (the document's language), so ctrl reads it as one."""
    resp = await running_ctrl.http.request(
        "DELETE", "/v1/templates/none", content=b'{"expected_version": 4224.0}',
        headers={**running_ctrl.operator, "Content-Type": "application/json"})
    error(resp, "not_found")  # judged on the template, not refused as a float


async def test_a_grant_with_a_plain_name_is_made(running_ctrl: RunningCtrl) -> None:
    made = result(await running_ctrl.http.post(
        "/v1/enrollment/grants", headers=running_ctrl.operator,
        json={"kind": "operator", "name": "Ünïcode name, 漢字", "expires_in_s": 60}))
    assert made["name"] == "Ünïcode name, 漢字"


async def test_an_implausible_incarnation_jump_is_refused(running_ctrl: RunningCtrl) -> None:
    """The first session may start anywhere up to the jump; after it, a jump of more
    than `MAX_INCARNATION_JUMP` is ``invalid_hello``, and the node keeps its number."""
    cred = await running_ctrl.enroll("node-a")
    async with running_ctrl.sim_node(cred, "node-a", MAX_INCARNATION_JUMP + 1) as node:
        assert node.first["type"] == "rejected"
        assert node.first["reason"] == "invalid_hello"
    async with running_ctrl.sim_node(cred, "node-a", 5) as node:
        assert node.first["type"] == "welcome"
    async with running_ctrl.sim_node(cred, "node-a", 6 + MAX_INCARNATION_JUMP) as node:
        assert node.first["reason"] == "invalid_hello"
        assert "implausible" in node.first["message"]
    assert (await running_ctrl.node("node-a"))["latest_session"]["incarnation"] == 5
