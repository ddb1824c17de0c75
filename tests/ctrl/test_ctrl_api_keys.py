"""API keys through ctrl's HTTP API: shown once and stored hashed, listed without their
secret, verified for a gateway (unknown, wrong and revoked alike refused), revoked at
once, strict input, operators only."""

from __future__ import annotations

import httpx
from ctrl_helpers import enroll_node, error, result
from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.ctrl.store.db import Store
from kibotos.ctrl.store.models import ApiKey, Command
from kibotos.ctrl.wire.api_keys import (
    ApiKeyCreateOut,
    ApiKeyListOut,
    ApiKeyOut,
    ApiKeyVerifyOut,
)


async def _create(client: httpx.AsyncClient, operator: dict[str, str], name: str,
                  **body: object) -> dict[str, object]:
    return dict(result(await client.post("/v1/api-keys", headers=operator,
                                         json={"name": name, **body}), ApiKeyCreateOut))


async def test_a_key_is_shown_once_stored_hashed_and_verified(
        client: httpx.AsyncClient, operator: dict[str, str], store: Store) -> None:
    made = await _create(client, operator, "ci", team="blue", command_id="c-1")
    key = str(made["key"])
    assert key.startswith(f"{made['key_id']}.")
    assert made["team"] == "blue"
    assert made["state"] == "active"

    def stored(session: Session) -> list[str]:
        rows = [r.secret_hash for r in session.scalars(select(ApiKey))]
        rows += [str(c.result) for c in session.scalars(select(Command))]
        return rows

    secret = key.partition(".")[2]
    assert all(secret not in text for text in await store.run(stored))
    listed = result(await client.get("/v1/api-keys", headers=operator), ApiKeyListOut)
    assert [k["key_id"] for k in listed["api_keys"]] == [made["key_id"]]
    assert secret not in str(listed)
    who = result(await client.post("/v1/api-keys/verify", headers=operator,
                                   json={"key": key}), ApiKeyVerifyOut)
    assert who == {"key_id": made["key_id"], "name": "ci", "team": "blue"}

    # A replayed create shows a fresh secret for the same key; the first stops working.
    again = await _create(client, operator, "ci", team="blue", command_id="c-1")
    assert again["key_id"] == made["key_id"]
    assert again["key"] != key
    error(await client.post("/v1/api-keys/verify", headers=operator, json={"key": key}),
          "unauthenticated")
    result(await client.post("/v1/api-keys/verify", headers=operator,
                             json={"key": again["key"]}), ApiKeyVerifyOut)


async def test_unknown_wrong_and_revoked_keys_are_refused_alike(
        client: httpx.AsyncClient, operator: dict[str, str]) -> None:
    made = await _create(client, operator, "dev")
    assert made["team"] == "default"
    key = str(made["key"])
    bad = [key + "x", "kak-00000000000000000000000000.secret", "no-dot", "e2b_123"]
    for token in bad:
        refused = error(await client.post("/v1/api-keys/verify", headers=operator,
                                          json={"key": token}), "unauthenticated")
        assert refused["message"] == "invalid API key (unknown, revoked or wrong)"
    revoked = result(await client.post(f"/v1/api-keys/{made['key_id']}/revoke",
                                       headers=operator, json={}), ApiKeyOut)
    assert revoked["state"] == "revoked"
    assert revoked["revoked_at"] is not None
    error(await client.post("/v1/api-keys/verify", headers=operator, json={"key": key}),
          "unauthenticated")
    error(await client.post("/v1/api-keys/kak-00000000000000000000000000/revoke",
                            headers=operator, json={}), "not_found")


async def test_input_is_strict_and_nothing_is_written(
        client: httpx.AsyncClient, operator: dict[str, str]) -> None:
    for body in ({"name": "Upper"}, {"name": "ok", "team": 7}, {"name": "ok", "x": 1},
                 {"team": "blue"}):
        error(await client.post("/v1/api-keys", headers=operator, json=body),
              "invalid_argument")
    error(await client.post("/v1/api-keys/verify", headers=operator, json={"key": 1}),
          "invalid_argument")
    listed = result(await client.get("/v1/api-keys", headers=operator), ApiKeyListOut)
    assert listed["api_keys"] == []


async def test_only_operators_manage_and_verify_keys(
        client: httpx.AsyncClient, operator: dict[str, str]) -> None:
    node = {"Authorization": f"Bearer {await enroll_node(client, operator, 'n1')}"}
    error(await client.post("/v1/api-keys", headers=node, json={"name": "x"}),
          "permission_denied")
    error(await client.post("/v1/api-keys/verify", headers=node, json={"key": "a.b"}),
          "permission_denied")
    error(await client.get("/v1/api-keys"), "unauthenticated")
