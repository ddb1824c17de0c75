"""Simulated nodes whose transfer commands are the node's real code
(`kibotos.node.storage.transfer` on a real pool directory, uploading to and downloading from a
real ctrl's artifact store with the node's credential), for test_transfers_api and
test_drain_rows."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from ws_helpers import WsCtrl

from kibotos.node.instances.commands import transfer_handlers
from kibotos.node.storage.objects import VOLUMES, PoolObjects
from kibotos.node.storage.pools.dirs import prepare_pool_dirs
from kibotos.node.storage.transfer import NodeTransfers
from kibotos.testing.sim_instances import SimInstances

MIB = 1 << 20
#: The capacity of the block files `released_block_file` makes.
CAPACITY = 64 * MIB


@dataclass
class TransferSim(SimInstances):
    """A simulated node whose ``object.export`` and ``object.import`` run the node's
    real code; the rest is simulated."""

    transfers: NodeTransfers | None = None
    REAL: ClassVar[tuple[str, ...]] = ("object.export", "object.import")
    KINDS = (*SimInstances.KINDS, *REAL)

    async def handle(self, kind: str, args: dict[str, Any]) -> dict[str, Any]:
        if kind in self.REAL:
            assert self.transfers is not None
            self.commands.append({"kind": kind, "args": args})
            return await transfer_handlers(self.transfers)[kind](args)
        return await super().handle(kind, args)


@dataclass
class ExportingSim(TransferSim):
    """One that only exports (it has no ``object.import``)."""

    REAL: ClassVar[tuple[str, ...]] = ("object.export",)
    KINDS = (*SimInstances.KINDS, *REAL)


S = TypeVar("S", bound=TransferSim)


def node_pool(tmp_path: Path, ctrl: WsCtrl, node_id: str, sim: type[S]) -> tuple[S, Path]:
    """A simulated node `node_id` of kind `sim`, with its own real pool directory
    ``<node_id>-local`` under `tmp_path` (returned too)."""
    path = tmp_path / f"{node_id}-local"
    path.mkdir()
    prepare_pool_dirs(f"{node_id}-local", path)

    def pool(pool_id: str, kind: str) -> PoolObjects:
        assert pool_id == f"{node_id}-local", pool_id
        return PoolObjects(pool_id, path, kind, node_id, receipt_wait=0.5)

    return sim(transfers=NodeTransfers(
        node_id=node_id, pool=pool, ctrl_url=ctrl.url,
        credential=lambda: ctrl.creds[node_id])), path


async def released_block_file(path: Path, volume_id: str, epoch: int, node_id: str, *,
                              data: bytes, offset: int) -> Path:
    """What the node's ``volume.create`` would have made (the simulated node only
    records it): a real block file of `CAPACITY` in pool directory `path` with `data`
    at `offset`, released at `epoch`; returns its path."""
    objs = PoolObjects(path.name, path, VOLUMES, node_id)
    opened = await objs.open(volume_id, epoch, create_capacity=CAPACITY)
    fd = os.open(opened.path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)
    objs.release(volume_id, epoch, confirmed_on_disk=True)
    return opened.path
