"""``POST /v1/workspaces/{workspace_id}/sessions``: a session credential for a Workspace.

An operator asks for access to a running Workspace; ctrl answers with where its data
plane is and a credential the data plane verifies on its own
(`kibotos.credentials`, docs/dataplane.md)::

    {"dataplane_url": "http://10.0.0.7:7500", "credential": "eyJ….MEUC…",
     "expires_at": "2026-01-01T00:05:00.000Z", "instance_id": "inst-…"}

Only an AVAILABLE Workspace has somewhere to go: any other state, or a node that never
reported a data-plane address, is ``failed_precondition`` naming what is missing.  The
credential names the Workspace's current Instance and its node, so it stops working
when the Workspace stops or moves (the node's data plane drops the target) and when it
expires, five minutes after issue.

The write is not journaled although the body may carry ``command_id`` (the CLI always
sends one): a credential is a secret and ctrl never stores one, and a second call just
issues another, equally valid credential, which is what a retry wants anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Literal

from pydantic import Field
from sqlalchemy.orm import Session
from starlette.requests import Request

from kibotos.credentials import LIFETIME, OPERATIONS
from kibotos.ctrl.api.auth import Caller
from kibotos.ctrl.api.routing import Api, Route, path_workspace_id, read_body
from kibotos.ctrl.store.models import Node, Workspace
from kibotos.ctrl.wire.base import Result, WriteRequest, iso
from kibotos.errors import FailedPrecondition, NotFound

#: `kibotos.credentials.OPERATIONS` as a type (a test keeps the two equal).
Operation = Literal["exec", "files", "ports"]


def _default_operations() -> list[Operation]:
    return ["exec"]


class WorkspaceSessionIn(WriteRequest):
    operations: list[Operation] = Field(default_factory=_default_operations, min_length=1,
                                        max_length=len(OPERATIONS))


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
    if ws is None or ws.state == "DELETED":
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


def dataplane_url(address: str) -> str:
    """The base URL of a node's data plane from its reported ``host:port``."""
    return f"http://{address}"


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

    return [
        Route("POST", "/v1/workspaces/{workspace_id}/sessions", create_session,
              "A short-lived credential for the data plane of an AVAILABLE Workspace",
              body=WorkspaceSessionIn, result=WorkspaceSessionOut),
    ]
