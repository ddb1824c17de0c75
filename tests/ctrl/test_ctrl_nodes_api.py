"""Node operations through the API (spec/nodes.txt): list and get, drain and
cancel-drain, isolate, retire.  Session facts are written to the store directly here;
test_ctrl_session.py drives them through a real control session."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest
from ctrl_helpers import enroll_node, error, exchange, read_node, result, update_node
from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.ctrl.live.context import CtrlContext
from kibotos.ctrl.model.nodes import IsolateCounts
from kibotos.ctrl.store.db import Store
from kibotos.ctrl.store.models import Event
from kibotos.ctrl.wire.base import IsolateOut, NodeListOut, NodeOut


async def _drain(client: httpx.AsyncClient, op: dict[str, str], node_id: str,
                 **body: object) -> httpx.Response:
    return await client.post(f"/v1/nodes/{node_id}/drain", headers=op, json=body)


async def test_list_pages_in_node_id_order(client: httpx.AsyncClient,
                                           operator: dict[str, str]) -> None:
    names = [f"node-{c}" for c in "gbeadfc"]
    for name in names:
        await enroll_node(client, operator, name)
    seen: list[str] = []
    token = None
    pages = 0
    while True:
        params = {"page_size": "3", **({"page_token": token} if token else {})}
        page = result(await client.get("/v1/nodes", headers=operator, params=params),
                      NodeListOut)
        assert len(page["nodes"]) <= 3
        assert all("host_usage" not in n for n in page["nodes"])
        seen.extend(n["node_id"] for n in page["nodes"])
        pages += 1
        token = page["next_page_token"]
        if token is None:
            break
        await enroll_node(client, operator, f"node-{'z' * pages}")  # inserts do not skew
    assert seen[:7] == sorted(names)
    assert seen == sorted(seen)
    assert len(seen) == len(set(seen))
    assert pages == 3
    everything = result(await client.get("/v1/nodes", headers=operator))
    assert everything["next_page_token"] is None
    assert len(everything["nodes"]) == len(seen)


@pytest.mark.parametrize(("params", "field"), [
    ({"page_size": "0"}, "page_size"),
    ({"page_size": "501"}, "page_size"),
    ({"page_size": "many"}, "page_size"),
    ({"order_by": "status"}, "order_by"),
    ({"page_token": "garbage!"}, "page_token"),
    ({"colour": "red"}, "colour"),
])
async def test_list_bad_parameters(client: httpx.AsyncClient, operator: dict[str, str],
                                   params: dict[str, str], field: str) -> None:
    resp = await client.get("/v1/nodes", headers=operator, params=params)
    assert field in error(resp, "invalid_argument")["message"]


async def test_get_unknown_and_malformed_node(client: httpx.AsyncClient,
                                              operator: dict[str, str]) -> None:
    err = error(await client.get("/v1/nodes/node-x", headers=operator), "not_found")
    assert "node-x" in err["message"]
    err = error(await client.get("/v1/nodes/-bad-", headers=operator), "invalid_argument")
    assert "node ID" in err["message"]
    error(await _drain(client, operator, "node-x"), "not_found")


async def test_get_shows_host_usage_only_while_alive(client: httpx.AsyncClient,
                                                     operator: dict[str, str],
                                                     store: Store, ctx: CtrlContext) -> None:
    await enroll_node(client, operator, "node-a")
    sample = {"at": "2026-01-01T00:00:00Z", "vm_cpu_cores": None, "memory_tight": False}
    await update_node(store, "node-a", host_usage=sample, session_alive=True, incarnation=4,
                      session_id="ses-1", session_started_at=ctx.now())
    node = result(await client.get("/v1/nodes/node-a", headers=operator), NodeOut)
    assert node["host_usage"] == sample
    assert node["status"] == "READY"
    assert node["latest_session"]["alive"] is True
    await update_node(store, "node-a", session_alive=False)
    node = result(await client.get("/v1/nodes/node-a", headers=operator), NodeOut)
    assert node["host_usage"] is None
    assert node["status"] == "OFFLINE"


async def test_node_fields(client: httpx.AsyncClient, operator: dict[str, str],
                           store: Store, ctx: CtrlContext) -> None:
    await enroll_node(client, operator, "node-a")
    now = ctx.now()
    await update_node(
        store, "node-a", session_alive=True, incarnation=2, session_id="ses-x",
        session_started_at=now - timedelta(seconds=5), release_version="0.1.0",
        source_revision="abc", clock_offset_ms=31_000.0, clock_uncertainty_ms=2_000.0,
        clock_sync_status="synchronized", clock_measured_at=now, report_at=now,
        resources_cpu_millis=4000, resources_memory_bytes=8 << 30,
        allocated_cpu_millis=1500, allocated_memory_bytes=1 << 30, instance_count=2,
        volume_count=1, memory_tight=True, memory_tight_since=now)
    node = result(await client.get("/v1/nodes/node-a", headers=operator), NodeOut)
    session = node["latest_session"]
    assert session["incarnation"] == 2
    assert session["release_version"] == "0.1.0"
    assert session["clock"]["offset_ms"] == 31_000.0
    assert session["clock"]["over"] is False  # 31 s − 2 s uncertainty is within 30 s
    assert node["latest_report"]["allocated"] == {"cpu_millis": 1500,
                                                  "memory_bytes": 1 << 30}
    assert node["latest_report"]["instance_count"] == 2
    assert node["resources"] == node["schedulable"] == {"cpu_millis": 4000,
                                                         "memory_bytes": 8 << 30}
    assert node["memory_tight"] is True
    assert node["memory_tight_since"].endswith("Z")
    assert node["placement"] == {"eligible": False, "reason": "host memory tight"}
    await update_node(store, "node-a", clock_offset_ms=-32_500.0, memory_tight=False)
    node = result(await client.get("/v1/nodes/node-a", headers=operator))
    assert node["latest_session"]["clock"]["over"] is True
    assert node["placement"] == {"eligible": False, "reason": "clock offset beyond 30 s"}
    await update_node(store, "node-a", clock_offset_ms=100.0)
    node = result(await client.get("/v1/nodes/node-a", headers=operator))
    assert node["placement"] == {"eligible": True, "reason": None}


async def test_drain_and_cancel(client: httpx.AsyncClient, operator: dict[str, str],
                                store: Store) -> None:
    await enroll_node(client, operator, "node-a")
    await update_node(store, "node-a", instance_count=1)
    node = result(await _drain(client, operator, "node-a", expected_version=1), NodeOut)
    assert node["drain_requested"]
    assert node["status"] == "DRAINING"
    assert node["registration_version"] == 2
    assert node["placement"]["eligible"] is False
    await update_node(store, "node-a", instance_count=0, volume_count=1)
    assert result(await client.get("/v1/nodes/node-a", headers=operator))["status"] == \
        "DRAINING"
    await update_node(store, "node-a", volume_count=0)
    assert result(await client.get("/v1/nodes/node-a", headers=operator))["status"] == \
        "DRAINED"
    error(await client.post("/v1/nodes/node-a/cancel-drain", headers=operator,
                            json={"expected_version": 1}), "aborted")
    node = result(await client.post("/v1/nodes/node-a/cancel-drain", headers=operator,
                                    json={"expected_version": 2}), NodeOut)
    assert not node["drain_requested"]
    assert node["status"] == "OFFLINE"
    assert node["registration_version"] == 3


async def test_isolate(client: httpx.AsyncClient, operator: dict[str, str], store: Store,
                       ctx: CtrlContext) -> None:
    await enroll_node(client, operator, "node-a")
    await update_node(store, "node-a", incarnation=5, session_alive=True, session_id="s")
    path = "/v1/nodes/node-a/isolate"
    err = error(await client.post(path, headers=operator, json={}), "invalid_argument")
    assert "confirm_host_cannot_write" in err["message"]
    error(await client.post(path, headers=operator,
                            json={"confirm_host_cannot_write": "yes please"}),
          "invalid_argument")
    err = error(await client.post(path, headers=operator,
                                  json={"confirm_host_cannot_write": True}),
                "failed_precondition")
    assert "live control session" in err["message"]
    assert (await read_node(store, "node-a")).isolated_incarnation is None

    calls: list[str] = []

    def releaser(session: Session, node_id: str, now: object) -> IsolateCounts:
        calls.append(node_id)
        return IsolateCounts(released_volumes=2, released_retained_layers=1,
                             failed_workspaces=1)

    ctx.isolate_releasers.extend([releaser, releaser])
    await update_node(store, "node-a", session_alive=False)
    version = (await read_node(store, "node-a")).registration_version
    out = result(await client.post(path, headers=operator,
                                   json={"confirm_host_cannot_write": True,
                                         "expected_version": version}), IsolateOut)
    assert out["node"]["isolated"] is True
    assert out["node"]["isolated_incarnation"] == 5
    assert out["node"]["status"] == "ISOLATED"
    assert out["node"]["registration_version"] == version + 1
    assert (out["released_volumes"], out["released_retained_layers"],
            out["failed_workspaces"]) == (4, 2, 2)
    assert calls == ["node-a", "node-a"]
    events = await store.run(lambda s: list(s.scalars(
        select(Event.kind).where(Event.subject == "node-a"))))
    assert "node.isolate" in events


async def test_isolate_of_a_node_without_releasers_counts_zero(
        client: httpx.AsyncClient, operator: dict[str, str]) -> None:
    await enroll_node(client, operator, "node-a")
    out = result(await client.post("/v1/nodes/node-a/isolate", headers=operator,
                                   json={"confirm_host_cannot_write": True}))
    assert (out["released_volumes"], out["released_retained_layers"],
            out["failed_workspaces"]) == (0, 0, 0)
    # A node that never connected is isolated at incarnation 0.
    assert out["node"]["isolated_incarnation"] == 0


async def test_retire_only_from_drained_or_isolated(client: httpx.AsyncClient,
                                                    operator: dict[str, str],
                                                    store: Store) -> None:
    for name in ("node-a", "node-b", "node-c"):
        await enroll_node(client, operator, name)
    await update_node(store, "node-a", session_alive=True, session_id="s", incarnation=1)
    err = error(await client.post("/v1/nodes/node-a/retire", headers=operator, json={}),
                "failed_precondition")
    assert "READY" in err["message"]
    await update_node(store, "node-b", drain_requested=True, instance_count=1)
    err = error(await client.post("/v1/nodes/node-b/retire", headers=operator, json={}),
                "failed_precondition")
    assert "DRAINING" in err["message"]
    # From DRAINED.
    await update_node(store, "node-b", instance_count=0)
    node = result(await client.post("/v1/nodes/node-b/retire", headers=operator,
                                    json={}), NodeOut)
    assert node["status"] == "RETIRED"
    assert node["retired"]
    assert node["retired_at"]
    # From isolated.
    result(await client.post("/v1/nodes/node-c/isolate", headers=operator,
                             json={"confirm_host_cannot_write": True}))
    node = result(await client.post("/v1/nodes/node-c/retire", headers=operator, json={}))
    assert node["status"] == "RETIRED"
    assert node["isolated"] is True


async def test_retired_is_final(client: httpx.AsyncClient, operator: dict[str, str],
                                store: Store) -> None:
    pending_token = None
    await enroll_node(client, operator, "node-a")
    pending = result(await client.post("/v1/enrollment/grants", headers=operator,
                                       json={"kind": "node", "node_id": "node-a"}))
    pending_token = pending["token"]
    await update_node(store, "node-a", drain_requested=True)
    result(await client.post("/v1/nodes/node-a/retire", headers=operator, json={}))
    for path, body in [("/v1/nodes/node-a/drain", {}),
                       ("/v1/nodes/node-a/cancel-drain", {}),
                       ("/v1/nodes/node-a/isolate", {"confirm_host_cannot_write": True}),
                       ("/v1/nodes/node-a/retire", {})]:
        err = error(await client.post(path, headers=operator, json=body),
                    "failed_precondition")
        assert "retired" in err["message"]
    error(await client.put("/v1/nodes/node-a/overcommit", headers=operator,
                           json={"cpu": "2"}), "failed_precondition")
    error(await client.post("/v1/enrollment/grants", headers=operator,
                            json={"kind": "node", "node_id": "node-a"}), "failed_precondition")
    listed = result(await client.get("/v1/enrollment/grants", headers=operator))
    states = {g["grant_id"]: g["state"] for g in listed["grants"]}
    assert states[pending["grant_id"]] == "revoked"
    resp = await client.post("/v1/enrollment/exchange",
                             json={"token": pending_token, "public_key": "x"})
    error(resp, "failed_precondition")
    node = result(await client.get("/v1/nodes/node-a", headers=operator))
    assert node["status"] == "RETIRED"  # the registration is kept


async def test_management_ops_bump_the_version(client: httpx.AsyncClient,
                                               operator: dict[str, str]) -> None:
    await enroll_node(client, operator, "node-a")
    versions = []
    for path in ("drain", "cancel-drain", "drain"):
        node = result(await client.post(f"/v1/nodes/node-a/{path}", headers=operator,
                                        json={}))
        versions.append(node["registration_version"])
    assert versions == [2, 3, 4]


async def test_node_credential_cannot_manage_nodes(client: httpx.AsyncClient,
                                                   operator: dict[str, str],
                                                   store: Store) -> None:
    node_cred = await enroll_node(client, operator, "node-a")
    headers = {"Authorization": f"Bearer {node_cred}"}
    error(await _drain(client, headers, "node-a"), "permission_denied")
    assert not (await read_node(store, "node-a")).drain_requested
    # And an operator credential is not a node credential for anything node-only either.
    other = await exchange(client, result(await client.post(
        "/v1/enrollment/grants", headers=operator, json={"kind": "operator"}))["token"])
    assert other["kind"] == "operator"


async def test_errors_have_one_shape(client: httpx.AsyncClient,
                                     operator: dict[str, str]) -> None:
    resp = await client.get("/v1/no/such/route")
    assert error(resp, "not_found")["message"].startswith("no such API route")
    resp = await client.delete("/v1/nodes", headers=operator)
    assert resp.status_code == 405
    assert resp.json()["error"]["code"] == "invalid_argument"
    resp = await client.post("/v1/nodes/node-a/drain",
                             headers={**operator, "Content-Type": "application/json"},
                             content=b"{not json")
    assert "not valid JSON" in error(resp, "invalid_argument")["message"]
    resp = await client.post("/v1/nodes/node-a/drain", headers=operator, json=[1, 2])
    assert "JSON object" in error(resp, "invalid_argument")["message"]
