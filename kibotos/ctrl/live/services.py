"""ctrl's live services as one value: what `kibotos.ctrl.serve.build_services` builds
once per ctrl and hands to the HTTP API (`kibotos.ctrl.api.app.build_app`), to the
session hub (as its observer) and to the metrics.

Nothing builds a service anywhere else, so every request, task and gauge of a ctrl
works on the same index, journal and in-flight map.  `run` is their lifetime: until it
runs, writes that need the services answer ``unavailable``.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from kibotos.ctrl.live.context import CtrlContext
from kibotos.ctrl.live.node_feed import NodeFeed
from kibotos.ctrl.live.object_ops import ObjectOps
from kibotos.ctrl.live.runtime import Runtime
from kibotos.ctrl.live.transfer_service import TransferService
from kibotos.ctrl.live.volume_service import VolumeService
from kibotos.ctrl.live.workspace_service import WorkspaceService
from kibotos.ctrl.store.artifacts import ArtifactStore


@dataclass(frozen=True)
class CtrlServices:
    ctx: CtrlContext
    runtime: Runtime
    workspaces: WorkspaceService
    feed: NodeFeed
    volumes: VolumeService
    objects: ObjectOps
    transfers: TransferService
    #: ctrl's artifact store (Templates' blobs, Transfer archives), prepared once.
    artifacts: ArtifactStore

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Serve until cancelled (`Runtime.run`)."""
        await self.runtime.run(task_status=task_status)
