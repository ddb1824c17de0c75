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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session
from starlette.requests import Request

from kibotos.core import ids
from kibotos.core.errors import PermissionDenied
from kibotos.ctrl.api.auth import Caller
from kibotos.ctrl.api.routing import Api, Handler, Route, identity_of, read_body, read_query
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


def _name(request: Request, kind: str) -> str:
    return ids.check_resource_name(request.path_params["name"], f"{kind} name")


def _secret_params(box: SecretBox, name: str, password: Any) -> dict[str, Any]:
    """Journal parameters: the name, and a keyed digest of the password if any."""
    if password is None:
        return {"name": name}
    return {"name": name, "password_mac": box.mac(password.get_secret_value(),
                                                  f"egress {name}")}


@dataclass(frozen=True)
class _NamedKind:
    """A kind of record known by its name (Egress, Resolver), as its list, get and
    delete read and write it: `kind` names it in errors, the journal and the handlers'
    names (the routes' operation IDs), `plural` in the list's."""

    kind: str
    plural: str
    list_all: Callable[[Session], dict[str, Any]]
    get_json: Callable[[Session, str], dict[str, Any]]
    delete: Callable[[Session, str, int | None], dict[str, Any]]


def _named_handlers(api: Api, named: _NamedKind) -> tuple[Handler, Handler, Handler]:
    """The list, get and delete handlers of a `_NamedKind`: Egresses and Resolvers are
    listed, read and deleted (refused while in use, by their store rules) alike."""
    store = api.ctx.store

    async def list_all(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await store.run(named.list_all)

    async def get_one(request: Request, caller: Caller | None) -> dict[str, Any]:
        name = _name(request, named.kind)
        return await store.run(lambda s: named.get_json(s, name))

    async def delete(request: Request, caller: Caller | None) -> dict[str, Any]:
        name = _name(request, named.kind)
        body = await read_body(request, NamedDeleteIn)
        return await api.journaled(f"{named.kind}.delete", {"name": name}, body, caller,
                                   lambda s: named.delete(s, name, body.expected_version))

    list_all.__name__ = f"list_{named.plural}"
    get_one.__name__ = f"get_{named.kind}"
    delete.__name__ = f"delete_{named.kind}"
    return list_all, get_one, delete


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

    list_egresses, get_egress, delete_egress = _named_handlers(api, _NamedKind(
        "egress", "egresses", records.list_egresses,
        lambda s, name: records.egress_json(records.get_egress(s, name)),
        records.delete_egress))

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

    list_resolvers, get_resolver, delete_resolver = _named_handlers(api, _NamedKind(
        "resolver", "resolvers", records.list_resolvers,
        lambda s, name: records.resolver_json(records.get_resolver(s, name)),
        records.delete_resolver))

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
