"""Identity and enrollment through the API: grants, exchange once, revoke, and who may
call what."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ctrl_helpers import (
    bearer,
    enroll_node,
    error,
    exchange,
    grant_direct,
    public_key,
    read_node,
    result,
    update_node,
)

from kibotos.ctrl.live.context import CtrlContext
from kibotos.ctrl.store.db import Store
from kibotos.ctrl.wire.base import (
    ExchangeOut,
    GrantCreateOut,
    GrantListOut,
    HealthOut,
    NodeOut,
    RevokeOut,
    WhoAmIOut,
)


async def test_health_needs_no_credential(client: httpx.AsyncClient) -> None:
    health = result(await client.get("/v1/health"), HealthOut)
    assert health["status"] == "ok"


async def test_first_operator_gets_in_with_a_direct_grant(client: httpx.AsyncClient,
                                                          store: Store) -> None:
    token = await grant_direct(store, "operator")
    assert token.startswith("kgr-")
    assert "." in token
    resp = await client.post("/v1/enrollment/exchange",
                             json={"token": token, "public_key": public_key()})
    issued = result(resp, ExchangeOut)
    assert issued["kind"] == "operator"
    assert issued["node_id"] is None
    identity_id, _, secret = issued["credential"].partition(":")
    assert identity_id == issued["identity_id"]
    assert identity_id.startswith("kid-")
    assert secret
    me = result(await client.get("/v1/whoami", headers=bearer(issued["credential"])),
                WhoAmIOut)
    assert me["identity_id"] == identity_id
    assert me["kind"] == "operator"


async def test_a_grant_is_exchanged_once(client: httpx.AsyncClient, store: Store) -> None:
    token = await grant_direct(store, "operator")
    await exchange(client, token)
    resp = await client.post("/v1/enrollment/exchange",
                             json={"token": token, "public_key": public_key()})
    assert "already been exchanged" in error(resp, "failed_precondition")["message"]


@pytest.mark.parametrize("token", ["nonsense", "kgr-01abc", "kgr-01abc.secret"])
async def test_bad_tokens_are_unauthenticated(client: httpx.AsyncClient, token: str) -> None:
    resp = await client.post("/v1/enrollment/exchange",
                             json={"token": token, "public_key": public_key()})
    error(resp, "unauthenticated")


async def test_wrong_secret_is_unauthenticated(client: httpx.AsyncClient,
                                               store: Store) -> None:
    token = await grant_direct(store, "operator")
    grant_id = token.partition(".")[0]
    resp = await client.post("/v1/enrollment/exchange",
                             json={"token": f"{grant_id}.wrong", "public_key": public_key()})
    error(resp, "unauthenticated")
    await exchange(client, token)  # the real secret still works afterwards


async def test_expired_grant_is_refused(client: httpx.AsyncClient, store: Store,
                                        ctx: CtrlContext) -> None:
    token = await grant_direct(store, "operator", expires_in_s=60)
    later = ctx.now() + timedelta(seconds=61)
    ctx.now = lambda: later
    resp = await client.post("/v1/enrollment/exchange",
                             json={"token": token, "public_key": public_key()})
    assert "expired" in error(resp, "failed_precondition")["message"]


async def test_public_key_forms(client: httpx.AsyncClient, store: Store) -> None:
    key = Ed25519PrivateKey.generate().public_key()
    pem = key.public_bytes(serialization.Encoding.PEM,
                           serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    resp = await client.post("/v1/enrollment/exchange",
                             json={"token": await grant_direct(store, "operator"),
                                   "public_key": pem})
    result(resp)
    token = await grant_direct(store, "operator")
    resp = await client.post("/v1/enrollment/exchange",
                             json={"token": token, "public_key": "bm90IGEga2V5"})
    assert "public_key" in error(resp, "invalid_argument")["message"]
    # A refused exchange used nothing up.
    await exchange(client, token)


async def test_node_grant_creates_an_admitted_node(client: httpx.AsyncClient,
                                                   operator: dict[str, str],
                                                   store: Store) -> None:
    resp = await client.post("/v1/enrollment/grants", headers=operator,
                             json={"kind": "node", "node_id": "node-a", "name": "rack 1",
                                   "expires_in_s": 3600})
    grant = result(resp, GrantCreateOut)
    assert grant["node_id"] == "node-a"
    assert grant["expires_at"].endswith("Z")
    # The node does not exist before the exchange.
    error(await client.get("/v1/nodes/node-a", headers=operator), "not_found")
    issued = await exchange(client, grant["token"])
    assert issued["kind"] == "node"
    assert issued["node_id"] == "node-a"
    node = result(await client.get("/v1/nodes/node-a", headers=operator), NodeOut)
    assert node["admission"] == "admitted"
    assert node["status"] == "OFFLINE"
    assert node["registration_version"] == 1
    me = result(await client.get("/v1/whoami", headers=bearer(issued["credential"])))
    assert me == {"identity_id": issued["identity_id"], "kind": "node", "node_id": "node-a",
                  "name": "rack 1"}


@pytest.mark.parametrize(("body", "field"), [
    ({"kind": "node"}, "node_id is required"),
    ({"kind": "operator", "node_id": "node-a"}, "must not be given"),
    ({"kind": "node", "node_id": "Bad_ID"}, "node_id"),
    ({"kind": "robot"}, "kind"),
    ({"kind": "operator", "expires_in_s": 0}, "expires_in_s"),
    ({"kind": "operator", "colour": "red"}, "colour"),
    ({"kind": "operator", "command_id": "-bad"}, "command_id"),
])
async def test_grant_bad_input(client: httpx.AsyncClient, operator: dict[str, str],
                               body: dict[str, object], field: str) -> None:
    resp = await client.post("/v1/enrollment/grants", headers=operator, json=body)
    assert field in error(resp, "invalid_argument")["message"]
    listed = result(await client.get("/v1/enrollment/grants", headers=operator))
    assert [g["kind"] for g in listed["grants"]] == ["operator"]  # only the fixture's


async def test_who_may_call_what(client: httpx.AsyncClient, operator: dict[str, str]) -> None:
    node = bearer(await enroll_node(client, operator, "node-a"))
    error(await client.get("/v1/nodes", headers=node), "permission_denied")
    error(await client.post("/v1/enrollment/grants", headers=node,
                            json={"kind": "operator"}), "permission_denied")
    error(await client.get("/v1/nodes"), "unauthenticated")
    error(await client.get("/v1/nodes", headers={"Authorization": "Basic abc"}),
          "unauthenticated")
    error(await client.get("/v1/nodes", headers=bearer("kid-01nobody:secret")),
          "unauthenticated")
    good = operator["Authorization"].removeprefix("Bearer ")
    error(await client.get("/v1/nodes", headers=bearer(good + "x")), "unauthenticated")
    result(await client.get("/v1/whoami", headers=node))


async def test_revoking_an_identity_refuses_it_at_once(client: httpx.AsyncClient,
                                                       operator: dict[str, str],
                                                       store: Store) -> None:
    other = await exchange(client, await grant_direct(store, "operator"))
    headers = bearer(other["credential"])
    result(await client.get("/v1/nodes", headers=headers))  # now cached
    revoked = result(await client.post("/v1/enrollment/revoke", headers=operator,
                                       json={"id": other["identity_id"]}), RevokeOut)
    assert revoked == {"revoked": [other["identity_id"]]}
    error(await client.get("/v1/nodes", headers=headers), "unauthenticated")
    # Revoking again changes nothing and says so.
    again = result(await client.post("/v1/enrollment/revoke", headers=operator,
                                     json={"id": other["identity_id"]}))
    assert again == {"revoked": []}


async def test_revoking_a_used_grant_revokes_its_identity(client: httpx.AsyncClient,
                                                          operator: dict[str, str],
                                                          store: Store) -> None:
    grant = result(await client.post("/v1/enrollment/grants", headers=operator,
                                     json={"kind": "node", "node_id": "node-b"}))
    issued = await exchange(client, grant["token"])
    revoked = result(await client.post("/v1/enrollment/revoke", headers=operator,
                                       json={"id": grant["grant_id"]}))
    assert set(revoked["revoked"]) == {grant["grant_id"], issued["identity_id"]}
    error(await client.get("/v1/whoami", headers=bearer(issued["credential"])),
          "unauthenticated")
    node = result(await client.get("/v1/nodes/node-b", headers=operator))
    assert node["admission"] == "revoked"
    assert node["status"] == "REVOKED"
    assert node["placement"] == {"eligible": False,
                                 "reason": "not admitted (identity revoked)"}


async def test_a_new_grant_readmits_a_revoked_node(client: httpx.AsyncClient,
                                                   operator: dict[str, str],
                                                   store: Store) -> None:
    credential = await enroll_node(client, operator, "node-c")
    identity_id = credential.partition(":")[0]
    result(await client.post("/v1/enrollment/revoke", headers=operator,
                             json={"id": identity_id}))
    assert (await read_node(store, "node-c")).admission == "revoked"
    await enroll_node(client, operator, "node-c")
    node = await read_node(store, "node-c")
    assert node.admission == "admitted"


async def test_revoke_bad_and_unknown_ids(client: httpx.AsyncClient,
                                          operator: dict[str, str]) -> None:
    error(await client.post("/v1/enrollment/revoke", headers=operator,
                            json={"id": "kgr-01nothere"}), "not_found")
    error(await client.post("/v1/enrollment/revoke", headers=operator,
                            json={"id": "kid-01nothere"}), "not_found")
    error(await client.post("/v1/enrollment/revoke", headers=operator,
                            json={"id": "node-a"}), "invalid_argument")


async def test_list_shows_states(client: httpx.AsyncClient, operator: dict[str, str],
                                 store: Store, ctx: CtrlContext) -> None:
    pending = result(await client.post("/v1/enrollment/grants", headers=operator,
                                       json={"kind": "operator", "name": "pending"}))
    revoked = result(await client.post("/v1/enrollment/grants", headers=operator,
                                       json={"kind": "operator"}))
    result(await client.post("/v1/enrollment/revoke", headers=operator,
                             json={"id": revoked["grant_id"]}))
    listed = result(await client.get("/v1/enrollment/grants", headers=operator), GrantListOut)
    states = {g["grant_id"]: g["state"] for g in listed["grants"]}
    assert states[pending["grant_id"]] == "pending"
    assert states[revoked["grant_id"]] == "revoked"
    assert "used" in states.values()  # the fixture operator's grant
    assert all("token" not in g and "secret_hash" not in g for g in listed["grants"])
    assert [i["state"] for i in listed["identities"]] == ["active"]
    later = ctx.now() + timedelta(days=2)
    ctx.now = lambda: later
    listed = result(await client.get("/v1/enrollment/grants", headers=operator))
    states = {g["grant_id"]: g["state"] for g in listed["grants"]}
    assert states[pending["grant_id"]] == "expired"


async def test_grant_replay_issues_a_fresh_secret(client: httpx.AsyncClient,
                                                  operator: dict[str, str]) -> None:
    body = {"kind": "node", "node_id": "node-d", "command_id": "grant-d"}
    first = result(await client.post("/v1/enrollment/grants", headers=operator, json=body))
    second = result(await client.post("/v1/enrollment/grants", headers=operator, json=body))
    assert second["grant_id"] == first["grant_id"]
    assert second["token"] != first["token"]
    assert {k: v for k, v in first.items() if k != "token"} == \
        {k: v for k, v in second.items() if k != "token"}
    # Only the newest token works, and once used, the replay cannot show one again.
    resp = await client.post("/v1/enrollment/exchange",
                             json={"token": first["token"], "public_key": public_key()})
    error(resp, "unauthenticated")
    await exchange(client, second["token"])
    resp = await client.post("/v1/enrollment/grants", headers=operator, json=body)
    error(resp, "failed_precondition")
    listed = result(await client.get("/v1/enrollment/grants", headers=operator))
    assert sum(g["node_id"] == "node-d" for g in listed["grants"]) == 1


async def test_grant_for_a_retired_node_is_refused(client: httpx.AsyncClient,
                                                   operator: dict[str, str],
                                                   store: Store) -> None:
    await enroll_node(client, operator, "node-e")
    pending = result(await client.post("/v1/enrollment/grants", headers=operator,
                                       json={"kind": "node", "node_id": "node-e"}))
    await update_node(store, "node-e", drain_requested=True)
    result(await client.post("/v1/nodes/node-e/retire", headers=operator, json={}))
    resp = await client.post("/v1/enrollment/grants", headers=operator,
                             json={"kind": "node", "node_id": "node-e"})
    assert "retired" in error(resp, "failed_precondition")["message"]
    # The grant issued before retirement was revoked with it.
    resp = await client.post("/v1/enrollment/exchange",
                             json={"token": pending["token"], "public_key": public_key()})
    assert "revoked" in error(resp, "failed_precondition")["message"]
