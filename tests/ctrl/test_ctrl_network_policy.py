"""A Workspace's network policy through the real HTTP API of a real ctrl, with simulated
nodes: what ``instance.create`` carries (the deployment default: the node's network;
an explicit policy resolved), placement by ``facts.network`` (a policy needs a node with
a network, public egress one that provides it), strict input, and the guest's
addresses in ``get``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ws_helpers import WsCtrl, events, open_ws_ctrl

from kibotos.ctrl.wire.workspaces import WorkspaceOut

PUBLIC = {"public_egress": True}
PRIVATE = {"public_egress": False}
DEFAULT_SENT = {"public_egress": True, "allow_out": [], "deny_out": [], "egress": None,
                "resolver": None}


def creates(ctrl: WsCtrl, node_id: str) -> list[dict[str, Any]]:
    return [c["args"] for c in ctrl.sims[node_id].commands if c["kind"] == "instance.create"]


async def test_default_policy_on_a_node_without_network_sends_none(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        ws = await ctrl.settled((await ctrl.create())["workspace_id"])
        WorkspaceOut.model_validate(ws)
        assert ws["network"] == {"policy": None, "revision": 1}
        assert ws["instance"]["network"] is None
        assert ws["instance"]["network_revision"] is None
        [args] = creates(ctrl, "node-a")
        assert "network" not in args
        assert "network_revision" not in args


@pytest.mark.parametrize("public", [True, False])
async def test_default_policy_gets_what_the_node_provides(tmp_path: Path,
                                                          public: bool) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", network={"public_egress": public})
        ws = await ctrl.settled((await ctrl.create())["workspace_id"])
        [args] = creates(ctrl, "node-a")
        assert args["network"] == {**DEFAULT_SENT, "public_egress": public}
        assert args["network_revision"] == 1
        assert ws["network"] == {"policy": None, "revision": 1}
        assert ws["instance"]["network"] == args["network"]
        assert ws["instance"]["network_revision"] == 1


async def test_an_explicit_policy_is_placed_on_a_node_that_can_enforce_it(
        tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        await ctrl.connect("node-b", network=PRIVATE)
        await ctrl.connect("node-c", network=PUBLIC)
        for _ in range(3):
            ws = await ctrl.create(network={"public_egress": True})
            assert ws["node_id"] == "node-c"
        for _ in range(3):
            ws = await ctrl.create(network={"public_egress": False})
            assert ws["node_id"] in ("node-b", "node-c")
        # The default goes anywhere, also to the node without a network.
        assert (await ctrl.create(node_id="node-a"))["node_id"] == "node-a"
        # Pinned to a node that cannot: refused, naming why.
        err = await ctrl.create(code="failed_precondition", node_id="node-b",
                                network={"public_egress": True})
        assert "does not provide public egress" in err["message"]
        err = await ctrl.create(code="failed_precondition", node_id="node-a",
                                network={"public_egress": False})
        assert "no network on the node" in err["message"]


async def test_no_node_with_public_egress_is_resource_exhausted(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        await ctrl.connect("node-b", network=PRIVATE)
        err = await ctrl.create(code="resource_exhausted", network={})
        assert err["details"]["reasons"] == {
            "no network on the node": 1,
            "the node does not provide public egress, which the Workspace's policy needs": 1}
        listed = await ctrl.call("GET", "/v1/workspaces")
        assert listed["workspaces"] == []


async def test_the_explicit_policy_is_sent_resolved(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", network=PUBLIC)
        await ctrl.call("POST", "/v1/egresses", json={
            "name": "corp", "address": "Proxy.Example:1080", "username": "u",
            "password": "hunter2-secret"})
        await ctrl.call("POST", "/v1/resolvers", json={
            "name": "dns", "upstream": "10.0.0.53", "via_egress": "corp"})
        policy = {"public_egress": True, "allow_out": ["198.18.0.10"],
                  "deny_out": ["0.0.0.0/0", "::/0"], "egress": "corp", "resolver": "dns"}
        ws = await ctrl.create(network=policy)
        stored = {**policy, "allow_out": ["198.18.0.10/32"]}
        assert ws["network"] == {"policy": stored, "revision": 1}
        [args] = creates(ctrl, "node-a")
        assert args["network"] == {
            "public_egress": True, "allow_out": ["198.18.0.10/32"],
            "deny_out": ["0.0.0.0/0", "::/0"],
            "egress": {"name": "corp", "revision": 1, "address": "proxy.example:1080",
                       "authenticated": True},
            "resolver": {"name": "dns", "revision": 1, "upstream": "10.0.0.53:53",
                         "via_egress": True}}
        got = await ctrl.settled(ws["workspace_id"])
        assert got["instance"]["network"] == args["network"]
        assert "hunter2-secret" not in str(args)
        assert "hunter2-secret" not in str(got)


async def test_names_that_do_not_resolve(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", network=PUBLIC)
        err = await ctrl.create(code="not_found", network={"egress": "nope"})
        assert err["message"] == "egress nope does not exist"
        err = await ctrl.create(code="not_found", network={"resolver": "nope"})
        assert err["message"] == "resolver nope does not exist"
        await ctrl.call("POST", "/v1/egresses", json={"name": "corp", "address": "p:1080"})
        await ctrl.call("POST", "/v1/resolvers", json={
            "name": "dns", "upstream": "10.0.0.53", "via_egress": "corp"})
        err = await ctrl.create(code="failed_precondition", network={"resolver": "dns"})
        assert "goes through egress corp" in err["message"]
        assert ctrl.sims["node-a"].commands == []


@pytest.mark.parametrize(("network", "field"), [
    ({"allow_out": ["10.0.0.1/8"]}, "network.allow_out.0"),
    ({"deny_out": ["example.org"]}, "network.deny_out.0"),
    ({"deny_out": "10.0.0.0/8"}, "network.deny_out"),
    ({"public_egress": "yes"}, "network.public_egress"),
    ({"public_egress": 1}, "network.public_egress"),
    ({"egress": "Corp"}, "network.egress"),
    ({"resolver": ""}, "network.resolver"),
    ({"allow_out": ["10.0.0.0/8"] * 513}, "network.allow_out"),
    ({"colour": "blue"}, "network.colour"),
    ("on", "network"),
])
async def test_bad_policies_are_refused_naming_the_field(tmp_path: Path, network: Any,
                                                         field: str) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", network=PUBLIC)
        err = await ctrl.create(code="invalid_argument", network=network,
                                command_id="c-bad")
        assert field in [f["field"] for f in err["details"]["fields"]], err
        assert ctrl.sims["node-a"].commands == []
        assert (await ctrl.call("GET", "/v1/workspaces"))["workspaces"] == []
        # Nothing was journaled either: the same command ID is free for good input.
        ws = await ctrl.create(command_id="c-bad")
        assert ws["state"] == "CREATING"


async def test_guest_addresses_show_once_the_node_reports_them(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        node = await ctrl.connect("node-a", network=PUBLIC)
        assert node.sim is not None
        node.sim.guest_addresses = ["10.200.0.3/31", "fd00::3/127"]
        ws = await ctrl.settled((await ctrl.create())["workspace_id"])
        assert ws["instance"]["addresses"] == ["10.200.0.3/31", "fd00::3/127"]
        WorkspaceOut.model_validate(ws)


async def test_the_create_event_and_replay_keep_the_policy(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", network=PUBLIC)
        body = {"network": {"deny_out": ["10.0.0.0/8"]}, "command_id": "c-1"}
        first = await ctrl.create(**body)
        again = await ctrl.create(**body)
        assert again == first
        assert len(creates(ctrl, "node-a")) == 1
        err = await ctrl.create(code="already_exists",
                                network={"deny_out": ["10.0.0.0/9"]}, command_id="c-1")
        assert err["details"]["operation"] == "workspace.create"
        kinds = [e["kind"] for e in await events(ctrl, first["workspace_id"])]
        assert kinds[0] == "transition"


async def test_the_move_check_refuses_a_node_that_cannot_enforce_the_policy(
        tmp_path: Path) -> None:
    shared = [{"id": "shared", "shared": True, "default": True}]
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", network=PUBLIC, pools=shared)
        await ctrl.connect("node-b", pools=shared)
        await ctrl.connect("node-c", network=PRIVATE, pools=shared)
        ws = await ctrl.settled((await ctrl.create(network={}))["workspace_id"])
        wid = ws["workspace_id"]
        err = await ctrl.call("GET", f"/v1/workspaces/{wid}/move-check",
                              params={"node_id": "node-b"}, code="failed_precondition")
        assert err["details"]["reason"].startswith("no network on the node")
        err = await ctrl.call("GET", f"/v1/workspaces/{wid}/move-check",
                              params={"node_id": "node-c"}, code="failed_precondition")
        assert "does not provide public egress" in err["message"]
        await ctrl.action(wid, "set-network", network={"public_egress": False})
        ok = await ctrl.call("GET", f"/v1/workspaces/{wid}/move-check",
                             params={"node_id": "node-c"})
        assert ok["node_id"] == "node-c"
        # The deployment default moves anywhere.
        await ctrl.action(wid, "set-network")
        ok = await ctrl.call("GET", f"/v1/workspaces/{wid}/move-check",
                             params={"node_id": "node-b"})
        assert ok["already_there"] is False
