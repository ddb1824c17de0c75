"""HTTP API of Workspaces (docs/workspaces.md): create, list, get, start, stop, delete,
set-network (docs/network.md), where they run (location queries), the move check and
the cleanup status.

Writes go through `WorkspaceService` (placement, node commands, the journal); reads are
plain store queries.  A Workspace ID of the wrong shape is `invalid_argument`, an
unknown one `not_found`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from sqlalchemy.orm import Session
from starlette.requests import Request

from kibotos.core.errors import FailedPrecondition
from kibotos.ctrl.api.auth import Caller
from kibotos.ctrl.api.routing import (
    Api,
    Route,
    identity_of,
    object_write,
    path_workspace_id,
    query_read,
    read_body,
    read_query,
    waiting_get,
)
from kibotos.ctrl.live.runtime import Runtime
from kibotos.ctrl.live.workspace_service import WorkspaceService
from kibotos.ctrl.model import instances as inst_mod
from kibotos.ctrl.model import network_policy as netpol
from kibotos.ctrl.model import workspace_records as w
from kibotos.ctrl.pools import use_rights, volume_attach
from kibotos.ctrl.store.models import Instance, Node, existing
from kibotos.ctrl.wire.base import VersionedWrite
from kibotos.ctrl.wire.network import WorkspaceSetNetworkIn
from kibotos.ctrl.wire.workspaces import (
    CleanupStatusOut,
    LocationListOut,
    LocationOut,
    LocationQuery,
    MoveCheckOut,
    MoveCheckQuery,
    WorkspaceCreateIn,
    WorkspaceGetQuery,
    WorkspaceListOut,
    WorkspaceListQuery,
    WorkspaceOut,
    WorkspaceStartIn,
    WorkspaceStopIn,
)


def _node_or_404(session: Session, node_id: str) -> Node:
    return existing(session, Node, node_id, "node", "node_id")


def _list(query: WorkspaceListQuery, session: Session) -> dict[str, Any]:
    rows, token = w.list_page(session, states=query.states(), labels=query.labels(),
                              page_size=query.page_size, page_token=query.page_token)
    return {"workspaces": [w.workspace_json(ws) for ws in rows], "next_page_token": token}


def _locations(query: LocationQuery, session: Session) -> dict[str, Any]:
    if query.node_id is not None:
        _node_or_404(session, query.node_id)
    rows, token = w.locations_page(session, node_id=query.node_id,
                                   instance_id=query.instance_id,
                                   page_size=query.page_size, page_token=query.page_token)
    return {"locations": [w.location_json(ws) for ws in rows], "next_page_token": token}


def _location(workspace_id: str, session: Session) -> dict[str, Any]:
    return w.location_json(w.get_workspace(session, workspace_id))


def _objects(session: Session, workspace_id: str) -> list[dict[str, Any]]:
    return [{"kind": r.object_kind, "object_id": r.object_id, "pool_id": r.pool_id,
             "holder_node_id": r.holder_node_id, "epoch": r.epoch}
            for r in use_rights.rights_of(session, workspace_id)]


def _cleanup(workspace_id: str, session: Session) -> dict[str, Any]:
    ws = w.get_workspace(session, workspace_id)
    instance_id = ws.current_instance_id or ws.last_instance_id
    inst = session.get(Instance, instance_id) if instance_id else None
    if inst is None:
        return {"workspace_id": workspace_id, "instance_id": None, "node_id": None,
                "items": [], "pending_since": None, "held": []}
    node = session.get(Node, inst.node_id)
    retired_at = node.retired_at if node is not None else None
    return {"workspace_id": workspace_id, "instance_id": inst.instance_id,
            "node_id": inst.node_id, "items": inst_mod.cleanup_items(inst, retired_at),
            **inst_mod.cleanup_pending(inst, retired_at)}


def routes(api: Api, service: WorkspaceService, runtime: Runtime) -> list[Route]:
    """The routes; writes and waiting reads go to `service`, the move check reads the
    nodes' pools from the `runtime`'s capacity index."""
    ctx = api.ctx

    async def create_workspace(request: Request, caller: Caller | None) -> dict[str, Any]:
        body = await read_body(request, WorkspaceCreateIn)
        return await service.create(body, identity_of(caller))

    list_workspaces = query_read("list_workspaces", api, WorkspaceListQuery, _list)
    get_workspace = waiting_get("get_workspace", path_workspace_id, WorkspaceGetQuery,
                                service.get)

    start_workspace = object_write("start_workspace", path_workspace_id, WorkspaceStartIn,
                                   service.start)
    stop_workspace = object_write("stop_workspace", path_workspace_id, WorkspaceStopIn,
                                  service.stop)
    delete_workspace = object_write("delete_workspace", path_workspace_id, VersionedWrite,
                                    service.delete)
    set_network = object_write("set_network", path_workspace_id, WorkspaceSetNetworkIn,
                               service.set_network)

    async def workspace_location(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await ctx.store.run(partial(_location, path_workspace_id(request)))

    workspace_locations = query_read("workspace_locations", api, LocationQuery, _locations)

    async def move_check(request: Request, caller: Caller | None) -> dict[str, Any]:
        workspace_id = path_workspace_id(request)
        query = read_query(request, MoveCheckQuery)
        runtime.watch.drain()

        def txn(session: Session) -> dict[str, Any]:
            ws = w.get_workspace(session, workspace_id)
            _node_or_404(session, query.node_id)
            # An object being expanded or moved: the move stops before doing anything.
            volume_attach.check_startable(session, workspace_id)
            return {"workspace": w.workspace_json(ws),
                    "objects": _objects(session, ws.workspace_id)}

        found = await ctx.store.run(txn)
        ws_json, objects = found["workspace"], found["objects"]
        entry = runtime.index.nodes.get(query.node_id)
        pools = entry.pools if entry is not None else {}
        # Its network policy: a move must not stop a Workspace the node cannot take.
        why = netpol.refusal(netpol.need_of(ws_json["network"]["policy"]),
                             entry.network if entry is not None else None)
        if why is not None:
            raise FailedPrecondition(
                f"workspace {workspace_id} cannot start on node {query.node_id}: {why}",
                details={"workspace_id": workspace_id, "node_id": query.node_id,
                         "reason": why})
        for obj in objects:
            pool = pools.get(obj["pool_id"])
            if pool is None or not pool.available:
                why = "is not attached to" if pool is None else "reports as unavailable"
                raise FailedPrecondition(
                    f"{obj['kind'].replace('_', ' ')} {obj['object_id']} of workspace "
                    f"{workspace_id} is in pool {obj['pool_id']}, which node {query.node_id} "
                    f"{why}: it cannot start there",
                    details={"workspace_id": workspace_id, "node_id": query.node_id,
                             "pool_id": obj["pool_id"], "object_id": obj["object_id"]})
        return {"workspace": ws_json, "node_id": query.node_id,
                # Runs there: a FAILED Workspace keeps its node until stop --force, but
                # a move must not report it as running.
                "already_there": ws_json["node_id"] == query.node_id
                and ws_json["state"] == "AVAILABLE",
                "objects": objects,
                "node_pools": sorted(p for p, fact in pools.items() if fact.available)}

    async def cleanup_status(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await ctx.store.run(partial(_cleanup, path_workspace_id(request)))

    return [
        Route("POST", "/v1/workspaces", create_workspace,
              "Create a Workspace: place it, have its node accept it, record it",
              body=WorkspaceCreateIn, result=WorkspaceOut),
        Route("GET", "/v1/workspaces", list_workspaces,
              "List Workspaces in ID order (DELETED ones only when asked by state)",
              query=WorkspaceListQuery, result=WorkspaceListOut),
        Route("GET", "/v1/workspaces/{workspace_id}", get_workspace,
              "One Workspace; wait_s waits for a settled state", query=WorkspaceGetQuery,
              result=WorkspaceOut),
        Route("POST", "/v1/workspaces/{workspace_id}/start", start_workspace,
              "Start a STOPPED or FAILED Workspace as a new Instance", body=WorkspaceStartIn,
              result=WorkspaceOut),
        Route("POST", "/v1/workspaces/{workspace_id}/stop", stop_workspace,
              "Stop a Workspace (STOPPING now, STOPPED once its node confirms)",
              body=WorkspaceStopIn, result=WorkspaceOut),
        Route("POST", "/v1/workspaces/{workspace_id}/delete", delete_workspace,
              "Delete a STOPPED or FAILED Workspace and its retained layer", body=VersionedWrite,
              result=WorkspaceOut),
        Route("POST", "/v1/workspaces/{workspace_id}/set-network", set_network,
              "Replace a Workspace's network policy: a running one's node applies it "
              "first, in one transaction; a stopped one's next start uses it",
              body=WorkspaceSetNetworkIn, result=WorkspaceOut),
        Route("GET", "/v1/workspaces/{workspace_id}/location", workspace_location,
              "The node and Instance a Workspace executes as (null if none)", result=LocationOut),
        Route("GET", "/v1/workspace-locations", workspace_locations,
              "The Workspaces executing on a node, or as a current Instance", query=LocationQuery,
              result=LocationListOut),
        Route("GET", "/v1/workspaces/{workspace_id}/move-check", move_check,
              "Whether a Workspace's objects are in pools the node reports available",
              query=MoveCheckQuery, result=MoveCheckOut),
        Route("GET", "/v1/workspaces/{workspace_id}/cleanup-status", cleanup_status,
              "What the Workspace's last Instance still holds, and who says so",
              result=CleanupStatusOut),
    ]
