"""The HTTP contract under hostile requests (issue 16, "Contract"), against hypercorn
on 127.0.0.1:0 (``running_ctrl``): 415 for a body that is not JSON, a query parameter
given twice refused, ``Allow`` on 405, no redirect for a trailing slash, a DELETED
Workspace's sessions answered by its state, and no exception text in a 500."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

import pytest
from ctrl_helpers import RunningCtrl, error, public_key
from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from kibotos.ctrl.api.enrollment import EXCHANGE_BODY_LIMIT
from kibotos.ctrl.store.models import Workspace

EXCHANGE = "/v1/enrollment/exchange"


@pytest.mark.parametrize("headers", [
    {"Content-Type": "text/plain"},
    {"Content-Type": "application/x-www-form-urlencoded"},
    {"Content-Type": "multipart/form-data; boundary=x"},
    {},
])
async def test_a_body_that_is_not_json_is_415(running_ctrl: RunningCtrl,
                                              headers: dict[str, str]) -> None:
    resp = await running_ctrl.http.post(EXCHANGE, content=b'{"token": "a", '
                                        b'"public_key": "b"}', headers=headers)
    assert resp.status_code == 415, resp.text
    assert resp.json()["error"]["code"] == "invalid_argument"


async def test_json_with_a_charset_and_an_empty_body_pass(running_ctrl: RunningCtrl) -> None:
    resp = await running_ctrl.http.post(
        EXCHANGE, content=f'{{"token": "kgr-x.y", "public_key": "{public_key()}"}}',
        headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert resp.status_code in (401, 403, 404), resp.text
    # No body and no Content-Type: an empty request, judged on its path (no such node).
    resp = await running_ctrl.http.post("/v1/nodes/node-z/drain",
                                        headers=running_ctrl.operator)
    error(resp, "not_found")


@pytest.mark.parametrize("path", ["/v1/nodes?page_size=5&page_size=500",
                                  "/v1/volumes?deleted=false&deleted=true",
                                  "/v1/workspaces?state=AVAILABLE&state=DELETED"])
async def test_a_query_parameter_given_twice_is_refused(running_ctrl: RunningCtrl,
                                                        path: str) -> None:
    err = error(await running_ctrl.http.get(path, headers=running_ctrl.operator),
                "invalid_argument")
    assert "more than once" in err["message"]


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("DELETE", "/v1/nodes", "GET, HEAD"),
    ("POST", "/v1/templates/base", "DELETE, GET, HEAD, PUT"),
    ("PATCH", "/v1/enrollment/grants", "GET, HEAD, POST"),
])
async def test_405_names_the_allowed_methods(running_ctrl: RunningCtrl, method: str,
                                             path: str, allowed: str) -> None:
    resp = await running_ctrl.http.request(method, path, headers=running_ctrl.operator)
    assert resp.status_code == 405
    assert resp.headers["allow"] == allowed
    assert resp.json()["error"]["details"]["allowed"] == allowed.split(", ")


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/nodes/"), ("PUT", "/v1/templates/"), ("DELETE", "/v1/templates/base/"),
    ("POST", "/v1/workspaces/"),
])
async def test_a_trailing_slash_is_not_found_not_redirected(running_ctrl: RunningCtrl,
                                                            method: str, path: str) -> None:
    resp = await running_ctrl.http.request(method, path, headers=running_ctrl.operator)
    assert "location" not in resp.headers
    error(resp, "not_found")


async def test_a_deleted_workspaces_sessions_are_answered_by_its_state(
        running_ctrl: RunningCtrl) -> None:
    now = datetime.now(UTC)

    def add(session: Session) -> None:
        session.add(Workspace(
            workspace_id="ws-gone", template_name="base", image_digest="sha256:" + "a" * 64,
            kernel_digest="sha256:" + "b" * 64, initramfs_digest="sha256:" + "c" * 64,
            labels={}, state="DELETED", reason=None, revision=3, cpu_millis=1000,
            memory_bytes=1 << 30, layer_size_bytes=10 << 30, layer_pool_id="pool-a",
            layer_ref="ref-gone", current_instance_id=None, node_id=None,
            last_instance_id=None, last_node_id=None, network_policy=None,
            network_egress=None, network_resolver=None, created_at=now, updated_at=now,
            deleted_at=now))

    await running_ctrl.ctx.store.write(add)
    got = await running_ctrl.http.get("/v1/workspaces/ws-gone", headers=running_ctrl.operator)
    assert got.json()["result"]["state"] == "DELETED"
    resp = await running_ctrl.http.post("/v1/workspaces/ws-gone/sessions", json={},
                                        headers=running_ctrl.operator)
    err = error(resp, "failed_precondition")
    assert err["details"]["state"] == "DELETED"


async def test_an_unexpected_error_names_no_exception(running_ctrl: RunningCtrl) -> None:
    """A handler that fails in a way nobody planned answers ``internal`` with a fixed
    text: the exception's class and message (here a path) are only in ctrl's log."""
    async def boom(request: Request) -> Response:
        raise RuntimeError("/var/lib/kibotos/ctrl/secret.key is unreadable")

    app = running_ctrl.app
    assert isinstance(app, Starlette)
    app.add_route("/v1/test-boom", boom, methods=["GET"])
    resp = await running_ctrl.http.get("/v1/test-boom")
    err = error(resp, "internal")
    assert "RuntimeError" not in resp.text
    assert "secret.key" not in resp.text
    assert "Traceback" not in resp.text
    assert err["message"].startswith("internal error")


async def test_the_openapi_document_states_the_body_rules(running_ctrl: RunningCtrl) -> None:
    doc = (await running_ctrl.http.get("/v1/openapi.json")).json()
    exchange = doc["paths"][EXCHANGE]["post"]
    assert exchange["requestBody"]["x-kibotos-body-limit"] == EXCHANGE_BODY_LIMIT
    assert {"413", "415"} <= set(exchange["responses"])
    assert "413" not in doc["paths"]["/v1/nodes"]["get"]["responses"]


@pytest.mark.parametrize(("byte_range", "status"), [
    ("bytes=abc", 400), ("lines=0-1", 400), ("bytes=5-1", 400), ("bytes=4096-", 416)])
async def test_a_bad_range_is_answered_in_the_envelope(running_ctrl: RunningCtrl,
                                                       byte_range: str, status: int) -> None:
    data = b"blob for range tests" * 10
    path = f"/v1/artifacts/sha256/{hashlib.sha256(data).hexdigest()}"
    ops = running_ctrl.operator
    assert (await running_ctrl.http.put(path, content=data, headers=ops)).status_code == 200
    resp = await running_ctrl.http.get(path, headers={**ops, "Range": byte_range})
    assert resp.status_code == status
    assert resp.json()["error"]["code"] == "invalid_argument"
    if status == 416:
        assert resp.headers["content-range"] == f"bytes */{len(data)}"
    ok = await running_ctrl.http.get(path, headers={**ops, "Range": "bytes=0-3"})
    assert ok.status_code == 206
    assert ok.content == data[:4]


async def test_a_blob_upload_is_octet_stream_and_has_one_url(running_ctrl: RunningCtrl) -> None:
    data = b"blob of one spelling"
    hexdigest = hashlib.sha256(data).hexdigest()
    ops = running_ctrl.operator
    path = f"/v1/artifacts/sha256/{hexdigest}"
    resp = await running_ctrl.http.put(path, content=data,
                                       headers={**ops, "Content-Type": "text/plain"})
    assert resp.status_code == 415, resp.text
    assert resp.json()["error"]["code"] == "invalid_argument"
    assert (await running_ctrl.http.get(path, headers=ops)).status_code == 404  # nothing kept
    stored = await running_ctrl.http.put(
        path, content=data, headers={**ops, "Content-Type": "application/octet-stream"})
    assert stored.json()["result"]["created"] is True
    # The digest's other spelling is an input of bodies, not a second URL of the blob.
    error(await running_ctrl.http.get(f"/v1/artifacts/sha256/sha256:{hexdigest}",
                                      headers=ops), "invalid_argument")


async def test_an_api_key_id_in_the_path_is_checked(running_ctrl: RunningCtrl) -> None:
    err = error(await running_ctrl.http.post("/v1/api-keys/KAK..x/revoke", json={},
                                             headers=running_ctrl.operator), "invalid_argument")
    assert "API key ID" in err["message"]


@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_plain_http_to_the_session_endpoint_is_426(running_ctrl: RunningCtrl,
                                                         method: str) -> None:
    """The session path is served (by upgrade only): 426 with ``Upgrade``, not 404."""
    resp = await running_ctrl.http.request(method, "/v1/node/session")
    assert resp.status_code == 426
    assert resp.headers["upgrade"] == "websocket"
    if method == "GET":
        assert resp.json()["error"]["code"] == "invalid_argument"
