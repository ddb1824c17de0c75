"""The OpenAPI document is built from the route table: every route is in it, with the
schemas of its body and result, the patterns of its IDs, HEAD where GET is, bytes where
bytes are; and it is what the running server serves: every served route is documented,
every documented method answers (with a documented status), every other method is 405."""

from __future__ import annotations

import re

import httpx
from ctrl_helpers import RunningCtrl, result
from starlette.routing import Route as StarletteRoute
from starlette.routing import WebSocketRoute

from kibotos.ctrl.api.app import build_app
from kibotos.ctrl.api.routing import Route
from kibotos.ctrl.live.services import CtrlServices

# The HTTP API table of docs/architecture.md.
DOCUMENTED = {
    ("get", "/v1/health"), ("post", "/v1/enrollment/exchange"), ("get", "/v1/whoami"),
    ("post", "/v1/enrollment/grants"), ("get", "/v1/enrollment/grants"),
    ("post", "/v1/enrollment/revoke"), ("post", "/v1/api-keys"), ("get", "/v1/api-keys"),
    ("post", "/v1/api-keys/{key_id}/revoke"), ("post", "/v1/api-keys/verify"),
    ("get", "/v1/nodes"), ("get", "/v1/nodes/{node_id}"),
    ("post", "/v1/nodes/{node_id}/drain"), ("post", "/v1/nodes/{node_id}/cancel-drain"),
    ("post", "/v1/nodes/{node_id}/isolate"), ("post", "/v1/nodes/{node_id}/retire"),
    ("get", "/v1/overcommit"), ("put", "/v1/overcommit/default"),
    ("put", "/v1/nodes/{node_id}/overcommit"), ("get", "/v1/node/session"),
    ("get", "/v1/openapi.json"),
    ("put", "/v1/artifacts/sha256/{hex}"), ("get", "/v1/artifacts/sha256/{hex}"),
    ("put", "/v1/templates/{name}"), ("get", "/v1/templates"), ("get", "/v1/templates/{name}"),
    ("delete", "/v1/templates/{name}"),
    ("post", "/v1/workspaces"), ("get", "/v1/workspaces"),
    ("get", "/v1/workspaces/{workspace_id}"), ("post", "/v1/workspaces/{workspace_id}/start"),
    ("post", "/v1/workspaces/{workspace_id}/stop"),
    ("post", "/v1/workspaces/{workspace_id}/delete"),
    ("get", "/v1/workspaces/{workspace_id}/location"), ("get", "/v1/workspace-locations"),
    ("get", "/v1/workspaces/{workspace_id}/move-check"),
    ("get", "/v1/workspaces/{workspace_id}/cleanup-status"),
    ("post", "/v1/workspaces/{workspace_id}/sessions"),
    ("post", "/v1/node/dataplane-certificate"),
    ("post", "/v1/volumes"), ("get", "/v1/volumes"), ("get", "/v1/volumes/{volume_id}"),
    ("post", "/v1/volumes/{volume_id}/delete"), ("post", "/v1/volumes/{volume_id}/expand"),
    ("post", "/v1/volumes/{volume_id}/move"),
    ("post", "/v1/workspaces/{workspace_id}/expand-layer"),
    ("post", "/v1/workspaces/{workspace_id}/move-layer"),
    ("get", "/v1/workspaces/{workspace_id}/layer"),
    ("get", "/v1/storage-pools"), ("get", "/v1/storage-pools/{pool_id}"),
    ("get", "/v1/storage-pools/{pool_id}/objects"),
    ("post", "/v1/storage-pools/{pool_id}/set-capacity"),
    ("post", "/v1/storage-pools/{pool_id}/declare-lost"),
    ("post", "/v1/transfers/export"), ("post", "/v1/transfers/import"),
    ("post", "/v1/workspaces/{workspace_id}/set-network"),
    ("post", "/v1/egresses"), ("get", "/v1/egresses"), ("get", "/v1/egresses/{name}"),
    ("post", "/v1/egresses/{name}/update"), ("delete", "/v1/egresses/{name}"),
    ("get", "/v1/egresses/{name}/credentials"),
    ("post", "/v1/resolvers"), ("get", "/v1/resolvers"), ("get", "/v1/resolvers/{name}"),
    ("delete", "/v1/resolvers/{name}"),
}


async def test_every_route_is_documented(client: httpx.AsyncClient,
                                         services: CtrlServices) -> None:
    resp = await client.get("/v1/openapi.json")
    assert resp.status_code == 200
    doc = resp.json()
    assert doc["openapi"].startswith("3.1")
    listed = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    table: list[Route] = build_app(services).state.routes
    assert {(r.method.lower(), r.path) for r in table} == DOCUMENTED
    heads = {("head", path) for method, path in DOCUMENTED if method == "get"}
    assert listed == DOCUMENTED | heads
    schemas = doc["components"]["schemas"]
    for route in table:
        op = doc["paths"][route.path][route.method.lower()]
        if route.body is not None:
            assert set(op["requestBody"]["content"]) == {"application/json"}
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.rsplit("/", 1)[1] in schemas
        if route.result is not None:
            schema = op["responses"]["200"]["content"]["application/json"]["schema"]
            assert schema["properties"]["result"]["$ref"].rsplit("/", 1)[1] in schemas
        assert (op["security"] == []) == (route.who == "anyone")
    list_params = {p["name"] for p in doc["paths"]["/v1/nodes"]["get"]["parameters"]}
    assert list_params == {"page_size", "page_token", "order_by"}
    node = schemas["NodeOut"]["properties"]
    for name in ("node_id", "admission", "drain_requested", "isolated", "retired", "status",
                 "registration_version", "latest_session", "latest_report", "resources",
                 "schedulable", "overcommit", "memory_tight", "memory_tight_since",
                 "host_usage"):
        assert name in node


async def test_the_document_needs_no_credential(client: httpx.AsyncClient) -> None:
    # Served as is, not wrapped in {"result": ...}: tools read it directly.
    doc = (await client.get("/v1/openapi.json")).json()
    assert "paths" in doc
    assert result(await client.get("/v1/health"))["status"] == "ok"


async def test_ids_have_their_patterns(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/v1/openapi.json")).json()
    for path, ops in doc["paths"].items():
        for op in ops.values():
            for param in op["parameters"]:
                if param["in"] == "path":
                    assert param["schema"]["pattern"].startswith("^"), (path, param)
    node = doc["paths"]["/v1/nodes/{node_id}"]["get"]["parameters"][0]["schema"]["pattern"]
    assert re.search(node, "node-a")
    assert not re.search(node, "Node_A")
    assert not re.search(node, "-a")
    assert not re.search(node, "x" * 64)
    # Body fields of an ID type carry the same pattern (pydantic's schema of the check).
    create = doc["components"]["schemas"]["WorkspaceCreateIn"]["properties"]
    template = create["template"]["pattern"]
    assert re.search(template, "base.v1")
    assert not re.search(template, "..")
    assert any(alt.get("pattern") == node for alt in create["node_id"]["anyOf"])
    command = create["command_id"]["anyOf"][0]["pattern"]
    assert re.search(command, "cmd-1/stop")
    assert not re.search(command, "a b")
    digest = doc["components"]["schemas"]["TemplatePutIn"]["properties"]["image_digest"]
    assert re.search(digest["pattern"], "sha256:" + "0" * 64)
    assert not re.search(digest["pattern"], "sha256:" + "0" * 63)


async def test_blobs_are_octet_stream_and_head_is_listed(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/v1/openapi.json")).json()
    blob = doc["paths"]["/v1/artifacts/sha256/{hex}"]
    assert set(blob["put"]["requestBody"]["content"]) == {"application/octet-stream"}
    assert set(blob["get"]["responses"]["200"]["content"]) == {"application/octet-stream"}
    assert "Content-Range" in blob["get"]["responses"]["206"]["headers"]
    assert {"400", "401", "404", "405", "416", "500", "default"} <= set(blob["get"]["responses"])
    assert "content" not in blob["head"]["responses"]["200"]
    assert blob["head"]["operationId"] == blob["get"]["operationId"] + "_head"
    grants = doc["paths"]["/v1/enrollment/grants"]["post"]["responses"]
    assert {"400", "401", "403", "405", "413", "415", "500", "default"} <= set(grants)
    assert "404" not in grants  # no path parameter: no object to miss
    assert "401" not in doc["paths"]["/v1/health"]["get"]["responses"]
    # No body is {}: required only where the model has a required field.
    assert doc["paths"]["/v1/enrollment/exchange"]["post"]["requestBody"]["required"] is True
    assert doc["paths"]["/v1/nodes/{node_id}/drain"]["post"]["requestBody"]["required"] is False


#: A value of each path parameter's shape, for requests to every documented path.
EXAMPLES = {"node_id": "node-x", "workspace_id": "ws-x", "volume_id": "vol-x",
            "key_id": "kak-x", "pool_id": "pool-x", "name": "x", "hex": "0" * 64}
METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")


def _served_routes(app: object) -> set[tuple[str, str]]:
    served: set[tuple[str, str]] = set()
    for route in app.router.routes:  # type: ignore[attr-defined]
        if isinstance(route, StarletteRoute):
            served |= {(method.lower(), route.path) for method in route.methods or ()}
        elif isinstance(route, WebSocketRoute):
            served.add(("get", route.path))
    return served


async def test_the_document_is_what_the_server_serves(running_ctrl: RunningCtrl) -> None:
    http = running_ctrl.http
    doc = (await http.get("/v1/openapi.json")).json()
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    # Prometheus text is outside the API and its document (docs/metrics.md).
    assert _served_routes(running_ctrl.app) - documented == {("get", "/metrics"),
                                                              ("head", "/metrics")}
    for path, ops in doc["paths"].items():
        for param in ops[next(iter(ops))]["parameters"]:
            if param["in"] == "path":
                assert re.search(param["schema"]["pattern"], EXAMPLES[param["name"]])
        url = path.format(**EXAMPLES)
        allowed = sorted(method.upper() for method in ops)
        for method in METHODS:
            # No credential: what every documented method answers before its handler.
            resp = await http.request(method, url)
            op = ops.get(method.lower())
            if op is None:
                assert resp.status_code == 405, (method, path, resp.text)
                assert resp.headers["allow"] == ", ".join(allowed), (method, path)
                if method != "HEAD":  # a HEAD answer has no body
                    assert resp.json()["error"]["details"]["allowed"] == allowed
                continue
            assert str(resp.status_code) in op["responses"], (method, path, resp.text)
            if method != "HEAD" and resp.status_code >= 400:
                assert set(resp.json()) == {"error"}, (method, path, resp.text)
