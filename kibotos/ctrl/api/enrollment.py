"""HTTP API of identity and enrollment: exchange, whoami, grants, revoke; and the API
keys gateways' callers present (create, list, revoke, and verify for a gateway).

A created grant's token is shown once and never stored, not even in the command
journal: the journal keeps the result without it.  Replaying the create (same command
ID, same input) while the grant is still pending issues a fresh secret for the same
grant and returns it; the old token stops working.  Once the grant was exchanged,
revoked or has expired, the replay is refused with failed_precondition.  An API key's
create follows the same rule (`api_keys.reissue`).

A gateway verifies its callers' keys with its own operator identity
(``POST /v1/api-keys/verify``): the key is a body field, never a header ctrl would
take for the gateway's own credential.
"""

from __future__ import annotations

from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy.orm import Session
from starlette.requests import Request

from kibotos._version import __version__
from kibotos.core import ids
from kibotos.core.errors import FailedPrecondition
from kibotos.ctrl.api.auth import Caller
from kibotos.ctrl.api.routing import Api, Route, identity_of, read_body
from kibotos.ctrl.model import api_keys, enrollment
from kibotos.ctrl.pools import facts as pool_facts
from kibotos.ctrl.store.models import EnrollmentGrant
from kibotos.ctrl.wire.api_keys import (
    ApiKeyCreateIn,
    ApiKeyCreateOut,
    ApiKeyListOut,
    ApiKeyOut,
    ApiKeyRevokeIn,
    ApiKeyVerifyIn,
    ApiKeyVerifyOut,
)
from kibotos.ctrl.wire.base import (
    ExchangeIn,
    ExchangeOut,
    GrantCreateIn,
    GrantCreateOut,
    GrantListOut,
    HealthOut,
    RevokeIn,
    RevokeOut,
    WhoAmIOut,
)
from kibotos.protocol import CloseReason


def _reissue(grant_id: str, now: datetime, session: Session) -> str:
    grant = session.get(EnrollmentGrant, grant_id, with_for_update=True)
    if grant is None or enrollment.grant_state(grant, now) != "pending":
        state = "gone" if grant is None else enrollment.grant_state(grant, now)
        raise FailedPrecondition(
            f"enrollment grant {grant_id} is {state}: its token cannot be shown again",
            details={"grant_id": grant_id, "state": state})
    secret = enrollment.new_secret()
    grant.secret_hash = enrollment.hash_secret(secret)
    return f"{grant_id}.{secret}"


#: The exchange takes a token and a public key (`ExchangeIn`: at most 1200 characters):
#: an unauthenticated caller gets no more room than that, with margin.
EXCHANGE_BODY_LIMIT = 8 << 10


def routes(api: Api) -> list[Route]:
    ctx = api.ctx

    async def health(request: Request, caller: Caller | None) -> dict[str, Any]:
        return {"status": "ok", "version": __version__}

    async def exchange(request: Request, caller: Caller | None) -> dict[str, Any]:
        body = await read_body(request, ExchangeIn)
        result = await ctx.store.write(partial(
            enrollment.exchange, token=body.token, public_key=body.public_key, now=ctx.now()))
        # Handed out over the connection the caller already verified (docs/enrollment.md).
        ca = ctx.cluster_ca.cert_pem.decode() if ctx.cluster_ca is not None else None
        return {**result, "cluster_ca": ca}

    async def whoami(request: Request, caller: Caller | None) -> dict[str, Any]:
        assert caller is not None
        return {"identity_id": caller.identity_id, "kind": caller.kind,
                "node_id": caller.node_id, "name": caller.name}

    async def create_grant(request: Request, caller: Caller | None) -> dict[str, Any]:
        assert caller is not None
        body = await read_body(request, GrantCreateIn)
        tokens: list[str] = []

        def txn(session: Session) -> dict[str, Any]:
            result = enrollment.create_grant(
                session, kind=body.kind, node_id=body.node_id, name=body.name,
                expires_in_s=body.expires_in_s, created_by=caller.identity_id,
                now=ctx.now())
            tokens.append(result.pop("token"))
            return {**result, "token": None}

        outcome = await api.journal.execute(
            operation="enrollment.create_grant", params={}, body=body,
            identity_id=caller.identity_id, fn=txn)
        result = dict(outcome.result)
        if outcome.replayed:
            result["token"] = await ctx.store.write(
                partial(_reissue, str(result["grant_id"]), ctx.now()))
        else:
            result["token"] = tokens[0]
        return result

    async def list_grants(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await ctx.store.run(partial(enrollment.list_all, now=ctx.now()))

    async def revoke(request: Request, caller: Caller | None) -> dict[str, Any]:
        assert caller is not None
        body = await read_body(request, RevokeIn)
        effects: list[enrollment.Revocation] = []

        def txn(session: Session) -> dict[str, Any]:
            done = enrollment.revoke(session, body.id, ctx.now())
            if done.node_ids:  # a revoked node holds no pool ID any more
                pool_facts.reconsider(session, ctx.now())
            effects.append(done)
            return {"revoked": done.revoked}

        outcome = await api.journal.execute(
            operation="enrollment.revoke", params={}, body=body,
            identity_id=caller.identity_id, fn=txn)
        if effects and not outcome.replayed:
            api.auth.forget(effects[0].identity_ids)
            for node_id in effects[0].node_ids:
                await ctx.sessions.close(node_id, CloseReason.REVOKED)
        return outcome.result

    async def create_api_key(request: Request, caller: Caller | None) -> dict[str, Any]:
        assert caller is not None
        body = await read_body(request, ApiKeyCreateIn)
        keys: list[str] = []

        def txn(session: Session) -> dict[str, Any]:
            record, key = api_keys.create(session, name=body.name, team=body.team,
                                          created_by=caller.identity_id, now=ctx.now())
            keys.append(key)
            return record

        outcome = await api.journal.execute(
            operation="api_key.create", params={}, body=body,
            identity_id=caller.identity_id, fn=txn)
        key_id = str(outcome.result["key_id"])
        key = await ctx.store.write(lambda s: api_keys.reissue(s, key_id)) \
            if outcome.replayed else keys[0]
        return {**outcome.result, "key": key}

    async def list_api_keys(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await ctx.store.run(api_keys.list_all)

    async def revoke_api_key(request: Request, caller: Caller | None) -> dict[str, Any]:
        key_id = ids.check_object_id(request.path_params["key_id"], "API key ID")
        body = await read_body(request, ApiKeyRevokeIn)
        outcome = await api.journal.execute(
            operation="api_key.revoke", params={"key_id": key_id}, body=body,
            identity_id=identity_of(caller),
            fn=lambda s: api_keys.revoke(s, key_id, ctx.now()))
        return outcome.result

    async def verify_api_key(request: Request, caller: Caller | None) -> dict[str, Any]:
        body = await read_body(request, ApiKeyVerifyIn)
        return await ctx.store.run(partial(api_keys.verify, token=body.key))

    return [
        Route("GET", "/v1/health", health, "Liveness and version of ctrl", result=HealthOut,
              who="anyone"),
        Route("POST", "/v1/enrollment/exchange", exchange,
              "Exchange a one-time enrollment grant for a long-lived identity", body=ExchangeIn,
              result=ExchangeOut, body_limit=EXCHANGE_BODY_LIMIT, who="anyone"),
        Route("GET", "/v1/whoami", whoami, "The calling identity", result=WhoAmIOut,
              who="identity"),
        Route("POST", "/v1/enrollment/grants", create_grant,
              "Issue a one-time enrollment grant for a node or an operator", body=GrantCreateIn,
              result=GrantCreateOut),
        Route("GET", "/v1/enrollment/grants", list_grants, "List grants and identities",
              result=GrantListOut),
        Route("POST", "/v1/enrollment/revoke", revoke,
              "Revoke a grant or an identity; a revoked identity is refused at once", body=RevokeIn,
              result=RevokeOut),
        Route("POST", "/v1/api-keys", create_api_key,
              "Create an API key of a team for the gateways (the key is shown once)",
              body=ApiKeyCreateIn, result=ApiKeyCreateOut),
        Route("GET", "/v1/api-keys", list_api_keys, "List API keys (never their secrets)",
              result=ApiKeyListOut),
        Route("POST", "/v1/api-keys/{key_id}/revoke", revoke_api_key,
              "Revoke an API key; a gateway refuses it from then on", body=ApiKeyRevokeIn,
              result=ApiKeyOut),
        Route("POST", "/v1/api-keys/verify", verify_api_key,
              "Whose API key a gateway's caller presented (unauthenticated if none's)",
              body=ApiKeyVerifyIn, result=ApiKeyVerifyOut),
    ]
