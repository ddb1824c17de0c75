"""HTTP API of Egresses and Resolvers (docs/network.md): create, list, get, update
(Egresses), delete, and the credentials endpoint nodes fetch an Egress revision's
username and password from.

Writes go through the command journal like every other.  An Egress's password is never
part of what the journal keeps: the body digest sees it as a `SecretStr` (masked), and
the path parameters given to the journal carry a keyed digest of it instead
(`SecretBox.mac`), so a replay with another password is still "other input".  No
response but the credentials carries it, and nothing here logs a body.

``GET /v1/egresses/{name}/credentials?revision=N`` is for nodes only, and only for a
node that runs an Instance that was sent that revision (or is being sent it right now:
`PendingGrants`); any other node gets ``permission_denied``, an operator too.  An
update that makes a new revision has the running Workspaces using the Egress switched
to it (`WorkspaceService.egress_changed`), so a rotated password reaches them without
a restart.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from sqlalchemy.orm import Session
from starlette.requests import Request

from kibotos import ids
from kibotos.ctrl.api.auth import Caller
from kibotos.ctrl.api.routing import Api, Route, identity_of, read_body, read_query
from kibotos.ctrl.live.workspace_service import WorkspaceService
from kibotos.ctrl.model import network_records as records
from kibotos.ctrl.store.secret_box import SecretBox
from kibotos.ctrl.wire.network import (
    CredentialsQuery,
    EgressCreateIn,
    EgressCredentialsOut,
    EgressListOut,
    EgressOut,
    EgressUpdateIn,
    EgressUpdateOut,
    NamedDeleteIn,
    ResolverCreateIn,
    ResolverListOut,
    ResolverOut,
)
from kibotos.errors import PermissionDenied


def _name(request: Request, kind: str) -> str:
    return ids.check_resource_name(request.path_params["name"], f"{kind} name")


def _secret_params(box: SecretBox, name: str, password: Any) -> dict[str, Any]:
    """Journal parameters: the name, and a keyed digest of the password if any."""
    if password is None:
        return {"name": name}
    return {"name": name, "password_mac": box.mac(password.get_secret_value(),
                                                  f"egress {name}")}


def routes(api: Api, workspaces: WorkspaceService) -> list[Route]:
    """The routes; an Egress update has `workspaces` switch the running Workspaces that
    use it, and the credentials check reads what it is sending (`egress_grants`)."""
    ctx = api.ctx
    grants = workspaces.egress_grants
    box = ctx.secrets
    assert box is not None, "build the context with build_context (it makes the key)"

    async def create_egress(request: Request, caller: Caller | None) -> dict[str, Any]:
        body = await read_body(request, EgressCreateIn)
        return await api.journaled("egress.create", _secret_params(box, body.name, body.password),
                                   body, caller,
                                   lambda s: records.create_egress(s, body, box, ctx.now()))

    async def list_egresses(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await ctx.store.run(records.list_egresses)

    async def get_egress(request: Request, caller: Caller | None) -> dict[str, Any]:
        name = _name(request, "egress")
        return await ctx.store.run(
            lambda s: records.egress_json(records.get_egress(s, name)))

    async def update_egress(request: Request, caller: Caller | None) -> dict[str, Any]:
        name = _name(request, "egress")
        body = await read_body(request, EgressUpdateIn)
        outcome = await api.journal.execute(
            operation="egress.update", params=_secret_params(box, name, body.password),
            body=body, identity_id=identity_of(caller),
            fn=lambda s: records.update_egress(s, name, body, box, ctx.now()))
        if not outcome.replayed and outcome.result.get("outcome") == "updated":
            workspaces.egress_changed(name)
        return outcome.result

    async def delete_egress(request: Request, caller: Caller | None) -> dict[str, Any]:
        name = _name(request, "egress")
        body = await read_body(request, NamedDeleteIn)
        return await api.journaled("egress.delete", {"name": name}, body, caller,
                                   lambda s: records.delete_egress(s, name, body.expected_version))

    async def egress_credentials(request: Request, caller: Caller | None) -> dict[str, Any]:
        assert caller is not None
        assert caller.node_id is not None
        name = _name(request, "egress")
        revision = read_query(request, CredentialsQuery).revision
        node_id = caller.node_id
        being_sent = grants.allows(node_id, name, revision)

        def txn(session: Session) -> dict[str, Any]:
            allowed = being_sent and records.node_trusted(session, node_id)
            if not (allowed or records.node_may_fetch(session, node_id, name, revision)):
                raise PermissionDenied(
                    f"node {node_id} runs no Instance that was sent egress {name} revision "
                    f"{revision}", details={"name": name, "revision": revision,
                                            "node_id": node_id})
            return records.credentials(session, name, revision, box)

        return await ctx.store.run(txn)

    async def create_resolver(request: Request, caller: Caller | None) -> dict[str, Any]:
        body = await read_body(request, ResolverCreateIn)
        return await api.journaled("resolver.create", {"name": body.name}, body, caller,
                                   lambda s: records.create_resolver(s, body, ctx.now()))

    async def list_resolvers(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await ctx.store.run(records.list_resolvers)

    async def get_resolver(request: Request, caller: Caller | None) -> dict[str, Any]:
        name = _name(request, "resolver")
        return await ctx.store.run(
            lambda s: records.resolver_json(records.get_resolver(s, name)))

    async def delete_resolver(request: Request, caller: Caller | None) -> dict[str, Any]:
        name = _name(request, "resolver")
        body = await read_body(request, NamedDeleteIn)
        return await api.journaled(
            "resolver.delete", {"name": name}, body, caller,
            partial(records.delete_resolver, name=name, expected=body.expected_version))

    return [
        Route("POST", "/v1/egresses", create_egress,
              "Create an Egress (a SOCKS5 endpoint; the password is stored sealed and "
              "never shown)", body=EgressCreateIn, result=EgressOut),
        Route("GET", "/v1/egresses", list_egresses, "List Egresses by name", result=EgressListOut),
        Route("GET", "/v1/egresses/{name}", get_egress, "One Egress", result=EgressOut),
        Route("POST", "/v1/egresses/{name}/update", update_egress,
              "Change an Egress's address or credentials (a new revision)", body=EgressUpdateIn,
              result=EgressUpdateOut),
        Route("DELETE", "/v1/egresses/{name}", delete_egress,
              "Delete an Egress no Workspace or Resolver uses", body=NamedDeleteIn,
              result=EgressOut),
        Route("GET", "/v1/egresses/{name}/credentials", egress_credentials,
              "An Egress revision's username and password, for a node running an "
              "Instance that was sent it", query=CredentialsQuery, result=EgressCredentialsOut,
              who="node"),
        Route("POST", "/v1/resolvers", create_resolver,
              "Create a Resolver (a DNS upstream, direct or through an Egress)",
              body=ResolverCreateIn, result=ResolverOut),
        Route("GET", "/v1/resolvers", list_resolvers, "List Resolvers by name",
              result=ResolverListOut),
        Route("GET", "/v1/resolvers/{name}", get_resolver, "One Resolver", result=ResolverOut),
        Route("DELETE", "/v1/resolvers/{name}", delete_resolver,
              "Delete a Resolver no Workspace uses", body=NamedDeleteIn, result=ResolverOut),
    ]
