"""``POST /v1/workspaces/{workspace_id}/sessions``: a session credential for a Workspace.

An operator asks for access to a running Workspace; ctrl answers with where its data
plane is and a credential the data plane verifies on its own
(`kibotos.core.credentials`, docs/dataplane.md)::

    {"dataplane_url": "https://10.0.0.7:7500", "credential": "eyJ….MEUC…",
     "expires_at": "2026-01-01T00:05:00.000Z", "instance_id": "inst-…"}

Only an AVAILABLE Workspace has somewhere to go: any other state, or a node that never
reported a data-plane address, is ``failed_precondition`` naming what is missing.  The
credential names the Workspace's current Instance and its node, so it stops working
when the Workspace stops or moves (the node's data plane drops the target) and when it
expires, five minutes after issue.

The write is not journaled although the body may carry ``command_id`` (the CLI always
sends one): a credential is a secret and ctrl never stores one, and a second call just
issues another, equally valid credential, which is what a retry wants anyway.

``POST /v1/node/dataplane-certificate`` is the node's: with its own credential it sends
the public half of its data-plane key and gets a certificate from the cluster CA for
the host of the data-plane address it reported, valid ``[tls]
dataplane_cert_lifetime`` (`kibotos.protocol.certificates`).  A node that is isolated,
retired or revoked gets none.  Nothing is stored: asking again issues another.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, Literal

from pydantic import Field
from sqlalchemy.orm import Session
from starlette.requests import Request

from kibotos.core.credentials import LIFETIME, OPERATIONS
from kibotos.core.errors import FailedPrecondition, NotFound
from kibotos.ctrl.api.auth import Caller
from kibotos.ctrl.api.routing import Api, Route, path_workspace_id, read_body
from kibotos.ctrl.model.network_records import node_trusted
from kibotos.ctrl.store.models import Node, Workspace
from kibotos.ctrl.wire.base import Result, WriteRequest, iso
from kibotos.protocol.certificates import (
    DataplaneCertificate,
    DataplaneCertificateRequest,
    dataplane_host,
    dataplane_url,
    load_public_key,
)

#: `kibotos.core.credentials.OPERATIONS` as a type (a test keeps the two equal).
Operation = Literal["exec", "files", "ports"]


def _default_operations() -> list[Operation]:
    return ["exec"]


class WorkspaceSessionIn(WriteRequest):
    operations: list[Operation] = Field(default_factory=_default_operations, min_length=1,
                                        max_length=len(OPERATIONS))


class DataplaneCertificateOut(Result, DataplaneCertificate):
    """`DataplaneCertificate` as the OpenAPI document shows it."""


class WorkspaceSessionOut(Result):
    dataplane_url: str
    credential: str
    expires_at: str
    instance_id: str


@dataclass(frozen=True)
class SessionTarget:
    """Where a Workspace runs, as a credential needs it."""

    workspace_id: str
    instance_id: str
    node_id: str
    dataplane_address: str


def resolve_target(session: Session, workspace_id: str) -> SessionTarget:
    """The current Instance, node and data-plane address of an AVAILABLE Workspace."""
    ws = session.get(Workspace, workspace_id)
    # A DELETED Workspace is still shown by GET: it is answered by its state, as every
    # other state that is not AVAILABLE is, not as one that does not exist.
    if ws is None:
        raise NotFound(f"workspace {workspace_id} does not exist",
                       details={"workspace_id": workspace_id})
    if ws.state != "AVAILABLE":
        raise FailedPrecondition(
            f"workspace {workspace_id} is {ws.state}: sessions need an AVAILABLE Workspace"
            + (f" (start it first: kibo workspace start {workspace_id})"
               if ws.state == "STOPPED" else ""),
            details={"workspace_id": workspace_id, "state": ws.state})
    if ws.current_instance_id is None or ws.node_id is None:
        raise FailedPrecondition(f"workspace {workspace_id} is AVAILABLE but has no current "
                                 "Instance", details={"workspace_id": workspace_id})
    node = session.get(Node, ws.node_id)
    address = node.dataplane_address if node is not None else None
    if not address:
        raise FailedPrecondition(
            f"node {ws.node_id} of workspace {workspace_id} has not reported a data-plane "
            "address", details={"workspace_id": workspace_id, "node_id": ws.node_id})
    return SessionTarget(workspace_id, ws.current_instance_id, ws.node_id, address)


_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "*"}


def dataplane_names(session: Session, node_id: str) -> list[str]:
    """The names a data-plane certificate of `node_id` carries: the host of the
    data-plane address it reported; `failed_precondition` when it may have none."""
    if not node_trusted(session, node_id):
        raise FailedPrecondition(f"node {node_id} is isolated, retired or revoked: it gets "
                                 "no data-plane certificate", details={"node_id": node_id})
    node = session.get(Node, node_id)
    address = node.dataplane_address if node is not None else None
    host = dataplane_host(address or "")
    if host in _WILDCARD_HOSTS:
        raise FailedPrecondition(
            f"node {node_id} reported the data-plane address {address!r}, which names no "
            "host a certificate can be issued for", details={"node_id": node_id})
    return [host]


def routes(api: Api) -> list[Route]:
    ctx = api.ctx

    async def create_session(request: Request, caller: Caller | None) -> dict[str, str]:
        assert caller is not None
        workspace_id = path_workspace_id(request)
        body = await read_body(request, WorkspaceSessionIn)
        key = ctx.session_signing_key
        if key is None:
            raise FailedPrecondition("this ctrl has no session signing key")
        target = await ctx.store.run(partial(resolve_target, workspace_id=workspace_id))
        now = ctx.now().timestamp()
        credential, claims = key.issue(
            workspace_id=target.workspace_id, instance_id=target.instance_id,
            node_id=target.node_id, operations=list(body.operations), now=now,
            lifetime=LIFETIME)
        return {
            "dataplane_url": dataplane_url(target.dataplane_address),
            "credential": credential,
            "expires_at": iso(datetime.fromtimestamp(claims.exp, UTC)) or "",
            "instance_id": target.instance_id,
        }

    async def dataplane_certificate(request: Request, caller: Caller | None
                                    ) -> dict[str, Any]:
        assert caller is not None
        assert caller.node_id is not None
        body = await read_body(request, DataplaneCertificateRequest)
        ca = ctx.cluster_ca
        if ca is None:
            raise FailedPrecondition("this ctrl has no cluster CA")
        names = await ctx.store.run(partial(dataplane_names, node_id=caller.node_id))
        issued = ca.issue(names, public_key=load_public_key(body.public_key),
                          lifetime=timedelta(seconds=ctx.config.tls.dataplane_cert_lifetime),
                          now=ctx.now())
        return DataplaneCertificate(certificate=issued.cert_pem.decode(),
                                    ca=ca.cert_pem.decode(),
                                    not_after=iso(issued.not_after) or "",
                                    names=names).model_dump()

    return [
        Route("POST", "/v1/workspaces/{workspace_id}/sessions", create_session,
              "A short-lived credential for the data plane of an AVAILABLE Workspace",
              body=WorkspaceSessionIn, result=WorkspaceSessionOut),
        Route("POST", "/v1/node/dataplane-certificate", dataplane_certificate,
              "A certificate from the cluster CA for the calling node's data-plane key "
              "and reported address", body=DataplaneCertificateRequest,
              result=DataplaneCertificateOut, who="node"),
    ]
