"""Every command ctrl sends goes through the real node's parser and is accepted.

A real ctrl (hypercorn, SQLite) runs the Workspace, Volume, Transfer, drain and
ended-Instance-record flows against one simulated node whose command handling begins
with the node's own: each command ctrl sends is first handed to the real node's
handler for its kind (`kibotos.node.instances.commands`, `kibotos.node.records.registry`,
`kibotos.node.storage.transfer`), which parses it with the same `kibotos.protocol` type,
before the simulation answers it.  The test fails if the node's parser refuses anything
ctrl built, and if some command of `kibotos.protocol.COMMANDS` was never sent (a flow
added to ctrl needs a line here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ctrl_helpers import wait_until
from transfer_sims import CAPACITY, TransferSim, node_pool, released_block_file
from volume_helpers import create_volume, settled_volume
from ws_helpers import open_ws_ctrl

from kibotos.core.errors import KibotosError
from kibotos.ctrl.live.registry_sweep import RegistrySweep
from kibotos.node.instances.commands import command_handlers
from kibotos.node.records import instance_records
from kibotos.node.records.registry import Registry, registry_handlers
from kibotos.protocol import COMMANDS, CreateSpec

SHARED = {"id": "shared-a", "shared": True, "default": False}


class ParsedOnly:
    """The Instance manager and storage as the node's handlers see them: each call
    records what the node parsed; nothing else happens (the simulation does the rest)."""

    drain_requested = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.storage = self

    async def _note(self, name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.calls.append((name, (args, kwargs)))
        return {}

    async def create(self, spec: CreateSpec) -> dict[str, Any]:
        return await self._note("create", spec)

    async def stop(self, instance_id: str, *, force: bool, deadline_s: float
                   ) -> dict[str, Any]:
        return await self._note("stop", instance_id, force=force, deadline_s=deadline_s)

    async def destroy(self, instance_id: str) -> dict[str, Any]:
        return await self._note("destroy", instance_id)

    async def delete_layer(self, pool_id: str, ref: str, epoch: int) -> dict[str, Any]:
        return await self._note("delete_layer", pool_id, ref, epoch)

    async def set_network(self, instance_id: str, network: Any, revision: int
                          ) -> dict[str, Any]:
        return await self._note("set_network", instance_id, network, revision)

    def set_drain_requested(self, requested: bool) -> None:
        self.calls.append(("set_drain_requested", ((requested,), {})))

    async def volume_create(self, volume_id: str, pool_id: str, capacity: int, epoch: int
                            ) -> dict[str, Any]:
        return await self._note("volume_create", volume_id, pool_id, capacity, epoch)

    async def volume_delete(self, volume_id: str, pool_id: str, epoch: int
                            ) -> dict[str, Any]:
        return await self._note("volume_delete", volume_id, pool_id, epoch)

    async def object_expand(self, kind: str, pool_id: str, object_id: str, epoch: int,
                            capacity: int) -> dict[str, Any]:
        return await self._note("object_expand", kind, pool_id, object_id, epoch, capacity)

    async def object_copy(self, kind: str, object_id: str, from_pool_id: str,
                          to_pool_id: str, epoch: int) -> dict[str, Any]:
        return await self._note("object_copy", kind, object_id, from_pool_id, to_pool_id,
                                epoch)


@dataclass
class NodeParsedSim(TransferSim):
    """`TransferSim` (``object.export``/``import`` are the node's code) whose other
    commands go through the node's handlers first, and whose ended-Instance records
    are the node's real registry in `registry_dir`."""

    registry_dir: Path | None = None
    parsed: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    #: Kinds ctrl sent that the node has no handler for (the simulation answered).
    unanswered: list[str] = field(default_factory=list)
    target: ParsedOnly = field(default_factory=ParsedOnly)
    REGISTRY: ClassVar[tuple[str, ...]] = ("registry.list", "registry.delete")
    KINDS = (*TransferSim.KINDS, *REGISTRY)

    async def handle(self, kind: str, args: dict[str, Any]) -> dict[str, Any]:
        if kind in self.REGISTRY:
            assert self.registry_dir is not None
            self.commands.append({"kind": kind, "args": args})
            return await self._by_the_node(
                registry_handlers(Registry(self.registry_dir)), kind, args)
        if kind in self.REAL:
            self.parsed.append(kind)  # the node's own transfer handlers (TransferSim)
            return await super().handle(kind, args)
        await self._by_the_node(command_handlers(self.target), kind, args)
        return await super().handle(kind, args)

    async def _by_the_node(self, handlers: Any, kind: str, args: dict[str, Any]
                           ) -> dict[str, Any]:
        if kind not in handlers:
            self.unanswered.append(kind)
            return {}
        try:
            result: dict[str, Any] = await handlers[kind](args)
        except KibotosError as exc:
            self.refused.append((kind, exc.message))
            raise
        self.parsed.append(kind)
        return result


async def test_every_command_ctrl_sends_is_accepted_by_the_node_s_parser(
        tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path, in_process=False) as ctrl:  # the node uploads over HTTP
        sim, pool = node_pool(tmp_path, ctrl, "node-a", NodeParsedSim)
        sim.registry_dir = tmp_path / "registry"
        await ctrl.connect("node-a", sim=sim, network={"public_egress": True}, pools=[
            {"id": "node-a-local", "shared": False, "default": True}, SHARED])

        # Volumes: create, export, import, delete (volume.*, object.export/import).
        vol = await create_volume(ctrl, pool_id="node-a-local", capacity_bytes=CAPACITY)
        vid = vol["volume_id"]
        assert (await settled_volume(ctrl, vid))["state"] == "AVAILABLE"
        await released_block_file(pool, vid, vol["epoch"], "node-a", data=b"x" * 4096,
                                  offset=0)
        out = await ctrl.call("POST", "/v1/transfers/export", json={"volume_id": vid})
        imported = await ctrl.call("POST", "/v1/transfers/import", json={
            "artifact_digest": out["artifact_digest"], "pool_id": "node-a-local"})
        gone = imported["volume"]["volume_id"]
        await ctrl.call("POST", f"/v1/volumes/{gone}/delete", json={})
        assert (await settled_volume(ctrl, gone))["state"] == "DELETED"

        # A Workspace with the Volume: create, switch its network, stop, expand, move
        # both objects, start, fail, delete (instance.*, object.expand/copy,
        # layer.delete).
        wid = (await ctrl.create(node_id="node-a",
                                 volumes=[{"volume_id": vid, "mount_point": "/data"}])
               )["workspace_id"]
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"
        # A network switch of the running Instance (instance.set_network).
        await ctrl.action(wid, "set-network", network={"deny_out": ["10.0.0.0/8"]})
        await ctrl.action(wid, "stop")
        assert (await ctrl.settled(wid))["state"] == "STOPPED"
        await ctrl.call("POST", f"/v1/volumes/{vid}/expand",
                        json={"capacity_bytes": 2 * CAPACITY})
        assert (await settled_volume(ctrl, vid))["capacity_bytes"] == 2 * CAPACITY
        await ctrl.call("POST", f"/v1/volumes/{vid}/move", json={"pool_id": "shared-a"})
        assert (await settled_volume(ctrl, vid))["pool_id"] == "shared-a"
        await ctrl.call("POST", f"/v1/workspaces/{wid}/move-layer",
                        json={"pool_id": "shared-a"})

        async def layer_moved() -> bool:
            got = await ctrl.call("GET", f"/v1/workspaces/{wid}/layer")
            return bool(got["pool_id"] == "shared-a" and got["operation"] is None)

        await wait_until(layer_moved, "the writable layer moved")
        await ctrl.action(wid, "start")
        started = await ctrl.settled(wid)
        assert started["state"] == "AVAILABLE"
        await sim.exit(started["instance"]["instance_id"])  # FAILED, still held there

        async def failed() -> bool:
            return (await ctrl.ws(wid))["state"] == "FAILED"

        await wait_until(failed, "the Workspace FAILED")
        await ctrl.action(wid, "delete")
        assert (await ctrl.settled(wid))["state"] == "DELETED"

        # The drain flag (node.drain) and the node's records (registry.list/delete).
        await ctrl.call("POST", "/v1/nodes/node-a/drain", json={})

        async def drained() -> bool:
            return sim.drain_requested

        await wait_until(drained, "node.drain reached the node")
        instance_records.write_registry_entry(sim.registry_dir, "inst-gone", {
            "workspace_id": "ws-gone", "state": "DESTROYED", "confirmed_on_disk": False,
            "ended_at": "2026-01-01T00:00:00+00:00"})
        sweep = RegistrySweep(ctrl.ctx, 3600.0, live_nodes=lambda: ["node-a"])
        assert await sweep.sweep_node("node-a") == ["inst-gone"]

    assert sim.refused == []
    assert sim.unanswered == [], "commands ctrl sends that the node has no handler for"
    assert set(sim.parsed) == set(COMMANDS), "a command ctrl never sent in this test"
    creates = [args[0] for name, (args, _) in sim.target.calls if name == "create"]
    assert [spec.layer.create for spec in creates] == [True, False]  # create, start
