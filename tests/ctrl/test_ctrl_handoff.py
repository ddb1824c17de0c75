"""The handoff state of a Workspace's writable layer and of its Volumes (spec:
storage-pools-on-nfs, "Moving a pool to another host": after a takeover from an
isolated node "the writable layer reports UNKNOWN"): a real ctrl with simulated nodes
on one shared pool (`kibotos.testing.sim_instances` reports ``released_cleanly`` as the
node does), read through the API and through ``kibo workspace get`` / ``volume get``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from click.testing import CliRunner, Result
from ctrl_helpers import wait_until
from volume_helpers import create_volume, settled_volume, volume
from ws_helpers import WsCtrl, events, open_ws_ctrl

from kibotos.cli.cluster.enrollment_cmds import render_config
from kibotos.cli.main import kibo_cli
from kibotos.ctrl.pools import handoffs
from kibotos.ctrl.wire.volumes import VolumeOut
from kibotos.ctrl.wire.workspaces import WorkspaceOut
from kibotos.testing.clock import ThreadAwareClock
from kibotos.testing.sim_instances import SimInstances

SHARED = [{"id": "shared-1", "shared": True, "default": True}]


def kibo_config(ctrl: WsCtrl, tmp_path: Path) -> Path:
    path = tmp_path / "kibo.toml"
    token = ctrl.operator["Authorization"].removeprefix("Bearer ")
    path.write_bytes(render_config(ctrl.url, token))
    path.chmod(0o600)
    return path


async def kibo(config: Path, *args: str) -> Result:
    """`kibo` in-process, in a thread (it runs its own event loop)."""
    env = {"COLUMNS": "200", "KIBO_ASCII": "1", "KIBO_CONFIG": str(config),
           "XDG_CONFIG_HOME": str(config.parent / "xdg")}
    result = await trio.to_thread.run_sync(lambda: CliRunner().invoke(
        kibo_cli, list(args), env=env, catch_exceptions=False))
    assert result.exit_code == 0, result.output
    return result


def row(out: str, label: str) -> str:
    """The value of one ``label:  value`` line of a ``get`` section."""
    for line in out.splitlines():
        if line.strip().startswith(label + ":"):
            return line.strip()[len(label) + 1:].strip()
    raise AssertionError(f"no {label!r} line in:\n{out}")


async def handoff_is(ctrl: WsCtrl, wid: str, want: str | None) -> dict[str, Any]:
    async def check() -> bool:
        return (await ctrl.ws(wid))["layer"]["handoff"] == want

    await wait_until(check, f"layer handoff of {wid} is {want}")
    return await ctrl.ws(wid)


async def test_takeover_from_an_isolated_node_reports_unknown_until_a_clean_start(
        tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path, in_process=False) as ctrl:
        objects: dict[Any, Any] = {}
        await ctrl.connect("node-a", pools=SHARED, sim=SimInstances(objects=objects))
        await ctrl.connect("node-b", pools=SHARED, sim=SimInstances(objects=objects))
        config = kibo_config(ctrl, tmp_path)
        vid = (await create_volume(ctrl, pool_id="shared-1"))["volume_id"]
        await settled_volume(ctrl, vid)
        wid = (await ctrl.create(node_id="node-a",
                                 volumes=[{"volume_id": vid}]))["workspace_id"]
        ws = await ctrl.settled(wid)
        assert ws["state"] == "AVAILABLE"
        WorkspaceOut.model_validate(ws)
        # A new layer never changed hands; the Volume was released by its create.
        assert ws["layer"]["handoff"] is None
        assert row((await kibo(config, "workspace", "get", wid)).stdout,
                   "Layer handoff") == "-"
        assert (await volume(ctrl, vid))["handoff"] == handoffs.CLEAN

        # node-a goes away without releasing anything; the operator isolates it and
        # the Workspace starts on node-b, which waits in vain for node-a's receipts.
        await ctrl.disconnect("node-a")
        await ctrl.call("POST", "/v1/nodes/node-a/isolate",
                        json={"confirm_host_cannot_write": True})
        started = await ctrl.action(wid, "start")
        assert started["node_id"] == "node-b"
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"
        ws = await handoff_is(ctrl, wid, handoffs.UNKNOWN)
        WorkspaceOut.model_validate(ws)
        vol = await volume(ctrl, vid)
        VolumeOut.model_validate(vol)
        assert vol["handoff"] == handoffs.UNKNOWN
        shown = (await kibo(config, "workspace", "get", wid)).stdout
        assert row(shown, "Layer handoff") == "UNKNOWN"
        got = json.loads((await kibo(config, "workspace", "get", wid, "--json")).stdout)
        assert got["result"]["layer"]["handoff"] == "UNKNOWN"
        assert row((await kibo(config, "volume", "get", vid)).stdout, "Handoff") == "UNKNOWN"
        seen = [e for e in await events(ctrl, wid) if e["kind"] == "handoff"]
        assert seen == [{"kind": "handoff", "object_kind": "retained_layer",
                         "object_id": ws["layer"]["ref"], "handoff": "UNKNOWN", "node_id": "node-b",
                         "instance_id": ws["instance_id"], "epoch": 2}]

        # node-b's reports repeat it; a stop leaves it: it is about the last open.
        await ctrl.action(wid, "stop")
        assert (await ctrl.settled(wid))["state"] == "STOPPED"
        assert (await ctrl.ws(wid))["layer"]["handoff"] == handoffs.UNKNOWN
        # The next start opens after node-b's own clean release: CLEAN again.
        await ctrl.action(wid, "start")
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"
        await handoff_is(ctrl, wid, handoffs.CLEAN)
        assert (await volume(ctrl, vid))["handoff"] == handoffs.CLEAN
        assert row((await kibo(config, "workspace", "get", wid)).stdout,
                   "Layer handoff") == "CLEAN"


async def test_a_stale_report_of_an_instance_no_longer_wanted_changes_nothing(
        tmp_path: Path, autojump_clock: ThreadAwareClock) -> None:
    """The isolated node comes back and lists its old Instance (at the old epoch) before
    it destroys it: that must not overwrite what the successor found."""
    async with open_ws_ctrl(tmp_path) as ctrl:
        objects: dict[Any, Any] = {}
        sim_a = SimInstances(objects=objects)
        await ctrl.connect("node-a", pools=SHARED, sim=sim_a)
        await ctrl.connect("node-b", pools=SHARED, sim=SimInstances(objects=objects))
        wid = (await ctrl.create(node_id="node-a"))["workspace_id"]
        await ctrl.settled(wid)
        old = next(iter(sim_a.instances.values()))
        await ctrl.disconnect("node-a")
        await ctrl.call("POST", "/v1/nodes/node-a/isolate",
                        json={"confirm_host_cannot_write": True})
        await ctrl.action(wid, "start")
        await ctrl.settled(wid)
        await handoff_is(ctrl, wid, handoffs.UNKNOWN)
        # Pretend node-a's old Instance had found a clean handoff: ctrl ignores it.
        old.objects = [{**o, "released_cleanly": True} for o in old.objects]
        await ctrl.connect("node-a", pools=SHARED, sim=sim_a, wait_eligible=False)

        async def discarded() -> bool:
            return any(c["kind"] in ("instance.destroy", "instance.discard")
                       for c in sim_a.commands) or not sim_a.instances

        await wait_until(discarded, "node-a's old Instance discarded")
        assert (await ctrl.ws(wid))["layer"]["handoff"] == handoffs.UNKNOWN
