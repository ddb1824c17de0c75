"""HTTP API of Volumes, and of the expansions and moves of Volumes and writable layers
(docs/storage.md, "Volumes"; docs/architecture.md, "HTTP API").

Writes go through `VolumeService` (create, delete) and `ObjectOps` (expand, move);
reads are store queries.  A Volume or Workspace ID of the wrong
shape is `invalid_argument`, an unknown one `not_found`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from sqlalchemy.orm import Session
from starlette.requests import Request

from kibotos.ctrl.api.auth import Caller
from kibotos.ctrl.api.routing import (
    Api,
    Route,
    identity_of,
    object_write,
    path_object_id,
    path_workspace_id,
    query_read,
    read_body,
    waiting_get,
)
from kibotos.ctrl.live.object_ops import ObjectOps
from kibotos.ctrl.live.volume_service import VolumeService
from kibotos.ctrl.pools import volume_txns as vt
from kibotos.ctrl.pools.object_op_txns import LAYER, VOLUME
from kibotos.ctrl.wire.base import VersionedWrite
from kibotos.ctrl.wire.volumes import (
    ExpandIn,
    LayerStatusOut,
    MoveIn,
    VolumeCreateIn,
    VolumeGetQuery,
    VolumeListOut,
    VolumeListQuery,
    VolumeOut,
)

path_volume_id = path_object_id("volume_id", "volume ID")


def _list(q: VolumeListQuery, session: Session) -> dict[str, Any]:
    return vt.list_page(session, pool_id=q.pool_id, workspace_id=q.workspace_id,
                        deleted=q.deleted, page_size=q.page_size, page_token=q.page_token)


def routes(api: Api, volumes: VolumeService, objects: ObjectOps) -> list[Route]:
    async def create_volume(request: Request, caller: Caller | None) -> dict[str, Any]:
        body = await read_body(request, VolumeCreateIn)
        return await volumes.create(body, identity_of(caller))

    list_volumes = query_read("list_volumes", api, VolumeListQuery, _list)

    get_volume = waiting_get("get_volume", path_volume_id, VolumeGetQuery, volumes.get)

    delete_volume = object_write("delete_volume", path_volume_id, VersionedWrite,
                                 volumes.delete)
    expand_volume = object_write("expand_volume", path_volume_id, ExpandIn,
                                 partial(objects.expand, VOLUME))
    move_volume = object_write("move_volume", path_volume_id, MoveIn,
                               partial(objects.move, VOLUME))
    expand_layer = object_write("expand_layer", path_workspace_id, ExpandIn,
                                partial(objects.expand, LAYER))
    move_layer = object_write("move_layer", path_workspace_id, MoveIn,
                              partial(objects.move, LAYER))

    async def layer_status(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await objects.status(LAYER, path_workspace_id(request))

    return [
        Route("POST", "/v1/volumes", create_volume,
              "Create a Volume (CREATING until its node made the block file)", body=VolumeCreateIn,
              result=VolumeOut),
        Route("GET", "/v1/volumes", list_volumes,
              "List Volumes in ID order (DELETED ones only with deleted=true)",
              query=VolumeListQuery, result=VolumeListOut),
        Route("GET", "/v1/volumes/{volume_id}", get_volume,
              "One Volume; wait_s waits for a settled state and no running operation",
              query=VolumeGetQuery, result=VolumeOut),
        Route("POST", "/v1/volumes/{volume_id}/delete", delete_volume,
              "Delete a Volume attached to no Workspace (DELETING, then DELETED)",
              body=VersionedWrite, result=VolumeOut),
        Route("POST", "/v1/volumes/{volume_id}/expand", expand_volume,
              "Expand a Volume (its Workspace stopped); follow it with get", body=ExpandIn,
              result=VolumeOut),
        Route("POST", "/v1/volumes/{volume_id}/move", move_volume,
              "Move a Volume to another pool through a node attached to both", body=MoveIn,
              result=VolumeOut),
        Route("POST", "/v1/workspaces/{workspace_id}/expand-layer", expand_layer,
              "Expand a stopped Workspace's writable layer", body=ExpandIn, result=LayerStatusOut),
        Route("POST", "/v1/workspaces/{workspace_id}/move-layer", move_layer,
              "Move a stopped Workspace's writable layer to another pool", body=MoveIn,
              result=LayerStatusOut),
        Route("GET", "/v1/workspaces/{workspace_id}/layer", layer_status,
              "A Workspace's writable layer: pool, size and running operation",
              result=LayerStatusOut),
    ]
