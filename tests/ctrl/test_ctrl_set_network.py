"""``POST /v1/workspaces/{id}/set-network``: a running Workspace's node applies the new
policy first (``instance.set_network`` with the next revision), then it is recorded; a
stopped one records it and its next start sends it; command IDs, expected revisions,
the states it is refused in, and a node that cannot enforce the policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from ws_helpers import WsCtrl, events, open_ws_ctrl

from kibotos.core.errors import FailedPrecondition
from kibotos.ctrl.live import workspace_service
from kibotos.ctrl.wire.workspaces import WorkspaceOut

PUBLIC = {"public_egress": True}
SHARED = [{"id": "shared", "shared": True, "default": True}]


def sent(ctrl: WsCtrl, node_id: str, kind: str) -> list[dict[str, Any]]:
    return [c["args"] for c in ctrl.sims[node_id].commands if c["kind"] == kind]


async def running(ctrl: WsCtrl, **body: Any) -> dict[str, Any]:
    ws = await ctrl.create(**body)
    ws = await ctrl.settled(ws["workspace_id"])
    assert ws["state"] == "AVAILABLE"
    return ws


async def set_network(ctrl: WsCtrl, workspace_id: str, code: str | None = None,
                      **body: Any) -> Any:
    return await ctrl.action(workspace_id, "set-network", code=code, **body)


async def test_a_running_workspace_is_switched_on_its_node(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", network=PUBLIC)
        ws = await running(ctrl)
        wid, revision = ws["workspace_id"], ws["revision"]
        policy = {"public_egress": False, "allow_out": ["198.18.0.10"],
                  "deny_out": ["0.0.0.0/0"]}
        out = await set_network(ctrl, wid, network=policy, expected_version=revision)
        WorkspaceOut.model_validate(out)
        [switch] = sent(ctrl, "node-a", "instance.set_network")
        assert switch == {"instance_id": ws["instance_id"], "revision": 2, "network": {
            "public_egress": False, "allow_out": ["198.18.0.10/32"],
            "deny_out": ["0.0.0.0/0"], "egress": None, "resolver": None}}
        assert out["revision"] == revision + 1
        assert out["state"] == "AVAILABLE"
        assert out["network"]["revision"] == 2
        assert out["network"]["policy"]["allow_out"] == ["198.18.0.10/32"]
        assert out["instance"]["network"] == switch["network"]
        assert out["instance"]["network_revision"] == 2
        # The node enforces what ctrl recorded.
        sim = ctrl.sims["node-a"].instances[ws["instance_id"]]
        assert sim.network is not None
        assert (sim.network.model_dump(mode="json"), sim.network_revision) == \
            (switch["network"], 2)
        got = await ctrl.ws(wid)
        assert got["network"] == out["network"]
        assert [e for e in await events(ctrl, wid) if e["kind"] == "network"] == [
            {"kind": "network", "revision": 2, "policy": out["network"]["policy"],
             "instance_id": ws["instance_id"], "node_id": "node-a", "cause": "set-network"}]
        # Back to the deployment default: the node's own network again.
        out = await set_network(ctrl, wid)
        assert out["network"] == {"policy": None, "revision": 3}
        last = sent(ctrl, "node-a", "instance.set_network")[-1]
        assert last["revision"] == 3
        assert last["network"]["public_egress"] is True


async def test_a_stopped_workspace_records_it_and_the_next_start_sends_it(
        tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", network=PUBLIC)
        ws = await running(ctrl)
        wid = ws["workspace_id"]
        await ctrl.action(wid, "stop")
        assert (await ctrl.settled(wid))["state"] == "STOPPED"
        out = await set_network(ctrl, wid, network={"deny_out": ["10.0.0.0/8"]})
        assert out["state"] == "STOPPED"
        assert out["network"]["revision"] == 2
        assert sent(ctrl, "node-a", "instance.set_network") == []
        await ctrl.action(wid, "start")
        got = await ctrl.settled(wid)
        start = sent(ctrl, "node-a", "instance.create")[-1]
        assert start["network_revision"] == 2
        assert start["network"]["deny_out"] == ["10.0.0.0/8"]
        assert got["instance"]["network"] == start["network"]


async def test_a_stopped_workspace_may_take_a_policy_its_old_node_cannot(
        tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", pools=SHARED)
        ws = await running(ctrl)
        wid = ws["workspace_id"]
        # Running on a node without a network: an explicit policy cannot be switched in.
        err = await set_network(ctrl, wid, code="failed_precondition", network={})
        assert "cannot enforce this policy" in err["message"]
        assert "no network on the node" in err["message"]
        await ctrl.action(wid, "stop")
        await ctrl.settled(wid)
        await set_network(ctrl, wid, network={})
        # Its next start needs a node with public egress: none yet, then one.
        err = await ctrl.action(wid, "start", code="resource_exhausted")
        assert "no network on the node" in err["message"]
        await ctrl.connect("node-b", network=PUBLIC, pools=SHARED)
        started = await ctrl.action(wid, "start")
        assert started["node_id"] == "node-b"


async def test_public_egress_on_a_node_without_it_is_refused(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", network={"public_egress": False})
        ws = await running(ctrl, network={"public_egress": False})
        err = await set_network(ctrl, ws["workspace_id"], code="failed_precondition",
                                network={"public_egress": True})
        assert "does not provide public egress" in err["message"]
        assert sent(ctrl, "node-a", "instance.set_network") == []
        assert (await ctrl.ws(ws["workspace_id"]))["revision"] == ws["revision"]


async def test_an_instance_started_without_a_network_cannot_switch(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        ws = await running(ctrl)
        # The node restarts with [network]; its Instance keeps running without one.
        sim = ctrl.sims["node-a"]
        await ctrl.disconnect("node-a")
        await ctrl.connect("node-a", sim=sim, network=PUBLIC)
        err = await set_network(ctrl, ws["workspace_id"], code="failed_precondition",
                                network={"deny_out": ["10.0.0.0/8"]})
        assert "started without a network" in err["message"]
        assert sent(ctrl, "node-a", "instance.set_network") == []


async def test_command_ids_and_expected_revisions(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", network=PUBLIC)
        ws = await running(ctrl)
        wid = ws["workspace_id"]
        err = await set_network(ctrl, wid, code="aborted", network={},
                                expected_version=ws["revision"] - 1)
        assert err["details"]["revision"] == ws["revision"]
        body = {"network": {"deny_out": ["10.0.0.0/8"]}, "command_id": "sn-1"}
        first = await set_network(ctrl, wid, **body)
        again = await set_network(ctrl, wid, **body)
        assert again == first
        assert len(sent(ctrl, "node-a", "instance.set_network")) == 1
        err = await set_network(ctrl, wid, code="already_exists", network={},
                                command_id="sn-1")
        assert err["details"]["operation"] == "workspace.set_network"
        # Bad input: nothing sent, nothing recorded.
        for bad in ({"network": {"deny_out": ["10.0.0.1/8"]}},
                    {"network": {"public_egress": "no"}}, {"policy": {}},
                    {"network": {}, "expected_version": "3"}):
            await set_network(ctrl, wid, code="invalid_argument", **bad)
        assert len(sent(ctrl, "node-a", "instance.set_network")) == 1
        assert (await ctrl.ws(wid))["revision"] == first["revision"]


async def test_refused_while_booting_or_deleted(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        node = await ctrl.connect("node-a", network=PUBLIC)
        assert node.sim is not None
        node.sim.hold_boots = trio.Event()
        ws = await ctrl.create()
        err = await set_network(ctrl, ws["workspace_id"], code="failed_precondition",
                                network={})
        assert "is CREATING" in err["message"]
        node.sim.hold_boots.set()
        await ctrl.settled(ws["workspace_id"])
        await ctrl.action(ws["workspace_id"], "stop")
        await ctrl.settled(ws["workspace_id"])
        await ctrl.action(ws["workspace_id"], "delete")
        assert (await ctrl.settled(ws["workspace_id"]))["state"] == "DELETED"
        await set_network(ctrl, ws["workspace_id"], code="failed_precondition", network={})
        await set_network(ctrl, "ws-nope", code="not_found", network={})


async def test_a_node_refusal_changes_nothing(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        node = await ctrl.connect("node-a", network=PUBLIC)
        assert node.sim is not None
        ws = await running(ctrl)
        node.sim.fail_network = FailedPrecondition("nft said no")
        err = await set_network(ctrl, ws["workspace_id"], code="failed_precondition",
                                network={"deny_out": ["10.0.0.0/8"]})
        assert err["message"] == "nft said no"
        got = await ctrl.ws(ws["workspace_id"])
        assert got["network"] == {"policy": None, "revision": 1}
        assert got["revision"] == ws["revision"]
        # The next switch takes the same revision: the refused one never happened.
        await set_network(ctrl, ws["workspace_id"], network={"deny_out": ["10.0.0.0/8"]})
        assert sent(ctrl, "node-a", "instance.set_network")[-1]["revision"] == 2


async def test_a_switch_whose_answer_was_lost_does_not_block_the_next(
        tmp_path: Path, monkeypatch: Any) -> None:
    """The node applied revision 2 but ctrl never heard back: the next switch, with
    another policy, goes as revision 3 (revision 2 again would be stale on the node
    forever)."""
    monkeypatch.setattr(workspace_service, "SWITCH_TIMEOUT", 0.5)
    async with open_ws_ctrl(tmp_path) as ctrl:
        node = await ctrl.connect("node-a", network=PUBLIC)
        assert node.sim is not None
        ws = await running(ctrl)
        wid = ws["workspace_id"]
        node.sim.hold_network_answer = held = trio.Event()
        await set_network(ctrl, wid, code="deadline_exceeded",
                          network={"deny_out": ["10.0.0.0/8"]})
        sim = node.sim.instances[ws["instance_id"]]
        assert sim.network_revision == 2
        node.sim.hold_network_answer = None
        held.set()
        out = await set_network(ctrl, wid, network={"deny_out": ["172.16.0.0/12"]})
        assert sent(ctrl, "node-a", "instance.set_network")[-1]["revision"] == 3
        assert out["network"]["revision"] == 3
        assert out["network"]["policy"]["deny_out"] == ["172.16.0.0/12"]
        assert (sim.network_revision, sim.network and sim.network.deny_out) == \
            (3, ["172.16.0.0/12"])
