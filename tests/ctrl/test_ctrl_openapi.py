"""The OpenAPI document is built from the route table: every route is in it, with the
schemas of its body and result."""

from __future__ import annotations

import httpx
from ctrl_helpers import result

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
    assert {(r.method.lower(), r.path) for r in table} == listed == DOCUMENTED
    schemas = doc["components"]["schemas"]
    for route in table:
        op = doc["paths"][route.path][route.method.lower()]
        if route.body is not None:
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
