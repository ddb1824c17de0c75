"""Workspace lifecycle through the real HTTP API of a real ctrl, with simulated nodes
answering the Instance commands: create, start, stop, delete, get, list, locations,
command IDs and expected revisions, events."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from ws_helpers import GI, TEMPLATE, events, open_ws_ctrl

from kibotos.ctrl.wire.workspaces import WorkspaceListOut, WorkspaceOut
from kibotos.testing.clock import ThreadAwareClock


async def test_create_places_boots_and_records(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        created = await ctrl.create(labels={"team": "ml"}, cpu_millis=500,
                                    memory_bytes=GI, layer_size_bytes=2 * GI)
        WorkspaceOut.model_validate(created)
        assert created["state"] == "CREATING"
        assert created["node_id"] == "node-a"
        assert created["template"]["name"] == TEMPLATE
        assert created["labels"] == {"team": "ml"}
        assert created["layer"] == {"pool_id": "node-a-local", "ref": created["layer"]["ref"],
                                    "size_bytes": 2 * GI, "handoff": None}
        ws = await ctrl.settled(created["workspace_id"])
        WorkspaceOut.model_validate(ws)
        assert ws["state"] == "AVAILABLE"
        assert ws["instance"]["state"] == "RUNNING"
        assert ws["instance"]["guest"]["boot_id"].startswith("boot-")
        # The node got the contract's arguments.
        create = ctrl.sims["node-a"].commands[0]
        assert create["kind"] == "instance.create"
        args = create["args"]
        assert args["workspace_id"] == ws["workspace_id"]
        assert args["instance_id"] == ws["instance_id"]
        assert args["template"]["image_digest"].startswith("sha256:")
        assert args["layer"] == {"pool_id": "node-a-local", "ref": ws["layer"]["ref"],
                                 "capacity_bytes": 2 * GI, "epoch": 1, "create": True}
        assert args["cpu_millis"] == 500
        assert args["memory_bytes"] == GI
        # Every transition is an event.
        kinds = [(e["from"], e["to"]) for e in await events(ctrl, ws["workspace_id"])
                 if e["kind"] == "transition"]
        assert kinds == [(None, "CREATING"), ("CREATING", "AVAILABLE")]


async def test_stop_start_delete(tmp_path: Path, autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        ws = await ctrl.create()
        wid = ws["workspace_id"]
        ws = await ctrl.settled(wid)
        first_instance = ws["instance_id"]
        stopping = await ctrl.action(wid, "stop")
        assert stopping["state"] == "STOPPING"
        ws = await ctrl.settled(wid)
        assert ws["state"] == "STOPPED"
        assert ws["node_id"] is None
        assert ws["instance_id"] is None
        assert ws["instance"]["confirmed_on_disk"] is True
        assert ws["last_node_id"] == "node-a"
        started = await ctrl.action(wid, "start")
        assert started["state"] == "STARTING"
        assert started["instance_id"] != first_instance
        ws = await ctrl.settled(wid)
        assert ws["state"] == "AVAILABLE"
        start_args = ctrl.sims["node-a"].commands[-1]["args"]
        assert start_args["layer"]["create"] is False
        assert start_args["layer"]["epoch"] == 1  # same (private) holder: no new epoch
        await ctrl.action(wid, "delete", code="failed_precondition")
        await ctrl.action(wid, "stop", force=True)
        ws = await ctrl.settled(wid)
        assert ws["state"] == "STOPPED"
        assert ws["instance"]["confirmed_on_disk"] is False
        deleting = await ctrl.action(wid, "delete")
        assert deleting["state"] == "DELETING"
        ws = await ctrl.settled(wid)
        assert ws["state"] == "DELETED"
        assert ws["deleted_at"] is not None
        assert ctrl.sims["node-a"].deleted_layers == [("node-a-local", ws["layer"]["ref"], 1)]
        # DELETED Workspaces are listed only when asked for by state.
        listed = await ctrl.call("GET", "/v1/workspaces")
        assert listed["workspaces"] == []
        listed = await ctrl.call("GET", "/v1/workspaces", params={"state": "deleted"})
        assert [w["workspace_id"] for w in listed["workspaces"]] == [wid]
        transitions = [(e["from"], e["to"]) for e in await events(ctrl, wid)
                       if e["kind"] == "transition"]
        assert transitions == [
            (None, "CREATING"), ("CREATING", "AVAILABLE"), ("AVAILABLE", "STOPPING"),
            ("STOPPING", "STOPPED"), ("STOPPED", "STARTING"), ("STARTING", "AVAILABLE"),
            ("AVAILABLE", "STOPPING"), ("STOPPING", "STOPPED"), ("STOPPED", "DELETING"),
            ("DELETING", "DELETED")]


async def test_list_filters_and_paging(tmp_path: Path, autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        ids = []
        for i in range(5):
            ws = await ctrl.create(labels={"team": "a" if i % 2 else "b", "n": str(i)},
                                   memory_bytes=256 << 20, cpu_millis=100)
            ids.append(ws["workspace_id"])
        for wid in ids:
            await ctrl.settled(wid)
        page = await ctrl.call("GET", "/v1/workspaces", params={"page_size": 2})
        WorkspaceListOut.model_validate(page)
        seen = [w["workspace_id"] for w in page["workspaces"]]
        while page["next_page_token"]:
            page = await ctrl.call("GET", "/v1/workspaces",
                                   params={"page_size": 2,
                                           "page_token": page["next_page_token"]})
            seen += [w["workspace_id"] for w in page["workspaces"]]
        assert seen == sorted(ids)
        team_a = await ctrl.call("GET", "/v1/workspaces", params={"label": "team=a"})
        assert sorted(w["workspace_id"] for w in team_a["workspaces"]) == sorted(ids[1::2])
        one = await ctrl.call("GET", "/v1/workspaces", params={"label": "team=b,n=4"})
        assert [w["workspace_id"] for w in one["workspaces"]] == [ids[4]]
        available = await ctrl.call("GET", "/v1/workspaces", params={"state": "AVAILABLE"})
        assert len(available["workspaces"]) == 5
        await ctrl.call("GET", "/v1/workspaces", params={"state": "RUNNING"},
                        code="invalid_argument")
        await ctrl.call("GET", "/v1/workspaces", params={"label": "team"},
                        code="invalid_argument")


async def test_locations_by_node_and_instance(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        ws = await ctrl.settled((await ctrl.create())["workspace_id"])
        wid, iid = ws["workspace_id"], ws["instance_id"]
        by_node = await ctrl.call("GET", "/v1/workspace-locations",
                                  params={"node_id": "node-a"})
        assert by_node["locations"] == [{"workspace_id": wid, "node_id": "node-a",
                                         "instance_id": iid}]
        by_inst = await ctrl.call("GET", "/v1/workspace-locations",
                                  params={"instance_id": iid})
        assert by_inst["locations"] == by_node["locations"]
        one = await ctrl.call("GET", f"/v1/workspaces/{wid}/location")
        assert one == by_node["locations"][0]
        await ctrl.call("GET", "/v1/workspace-locations", params={"node_id": "node-x"},
                        code="not_found")
        await ctrl.call("GET", "/v1/workspace-locations",
                        params={"node_id": "node-a", "instance_id": iid},
                        code="invalid_argument")
        await ctrl.action(wid, "stop")
        await ctrl.settled(wid)
        # Stopped: it runs nowhere, and its old Instance ID finds nothing.
        assert (await ctrl.call("GET", "/v1/workspace-locations",
                                params={"instance_id": iid}))["locations"] == []
        assert (await ctrl.call("GET", f"/v1/workspaces/{wid}/location"))["node_id"] is None


async def test_command_ids_replay_and_conflict(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        first = await ctrl.create(command_id="create-1")
        again = await ctrl.create(command_id="create-1")
        assert again == first
        creates = [c for c in ctrl.sims["node-a"].commands if c["kind"] == "instance.create"]
        assert len(creates) == 1  # the replay placed nothing
        err = await ctrl.create(code="already_exists", command_id="create-1",
                                labels={"x": "y"})
        assert err["details"] == {"command_id": "create-1", "operation": "workspace.create"}
        # A verdict reached before any transaction is journaled too.
        await ctrl.create(code="not_found", command_id="create-2", template="nope")
        await ctrl.create(code="not_found", command_id="create-2", template="nope")
        wid = first["workspace_id"]
        ws = await ctrl.settled(wid)
        await ctrl.action(wid, "stop", code="aborted", expected_version=ws["revision"] - 1)
        assert (await ctrl.ws(wid))["state"] == "AVAILABLE"
        stop = await ctrl.action(wid, "stop", command_id="stop-1",
                                 expected_version=ws["revision"])
        await ctrl.settled(wid)
        assert await ctrl.action(wid, "stop", command_id="stop-1",
                                 expected_version=ws["revision"]) == stop


async def test_bad_input_is_refused_before_anything(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        for body, field in [({"cpu_millis": 0}, "cpu_millis"),
                            ({"memory_bytes": 1000}, "memory_bytes"),
                            ({"layer_size_bytes": (64 << 20) + 1}, "layer_size_bytes"),
                            ({"labels": {"Bad Key": "x"}}, "labels"),
                            ({"node_id": "Node_A"}, "node_id"),
                            ({"template": "../etc"}, "template"),
                            ({"surprise": 1}, "surprise")]:
            err = await ctrl.create(code="invalid_argument", **body)
            assert field in err["message"]
        assert ctrl.sims["node-a"].commands == []
        await ctrl.call("GET", "/v1/workspaces/Not_An_Id", code="invalid_argument")
        await ctrl.call("GET", "/v1/workspaces/ws-nope", code="not_found")
        await ctrl.action("ws-nope", "start", code="not_found")
        assert (await ctrl.call("GET", "/v1/workspaces"))["workspaces"] == []


async def test_failed_boot_and_wait_returns_when_settled(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        sim = ctrl.sims["node-a"]
        sim.hold_boots = trio.Event()
        wid = (await ctrl.create())["workspace_id"]
        assert (await ctrl.ws(wid, wait_s=0.2))["state"] == "CREATING"
        sim.fail_boot = "the guest did not answer within 300 s"
        sim.hold_boots.set()
        ws = await ctrl.ws(wid, wait_s=30)
        assert ws["state"] == "FAILED"
        assert ws["reason"] == "the guest did not answer within 300 s"
        # The failed Instance still holds its resources: start needs stop --force.
        err = await ctrl.action(wid, "start", code="failed_precondition")
        assert "--force" in err["message"]
        await ctrl.action(wid, "stop", code="failed_precondition")
        await ctrl.action(wid, "stop", force=True)
        assert (await ctrl.settled(wid))["state"] == "STOPPED"
        sim.fail_boot = None
        await ctrl.action(wid, "start")
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"




@pytest.mark.postgres
async def test_lifecycle_on_postgresql(tmp_path: Path, postgres_url: str,
        autojump_clock: ThreadAwareClock) -> None:
    # PostgreSQL is where several ctrl replicas share the store: the chosen node is
    # checked again in the transaction that records the Allocation.
    async with open_ws_ctrl(tmp_path, database_url=postgres_url) as ctrl:
        assert ctrl.service.verify_in_store
        await ctrl.connect("node-a")
        wid = (await ctrl.create(labels={"team": "ml"}))["workspace_id"]
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"
        await ctrl.create(code="resource_exhausted", cpu_millis=3500)
        listed = await ctrl.call("GET", "/v1/workspaces", params={"label": "team=ml"})
        assert [w["workspace_id"] for w in listed["workspaces"]] == [wid]
        await ctrl.action(wid, "stop")
        assert (await ctrl.settled(wid))["state"] == "STOPPED"
        await ctrl.action(wid, "start")
        assert (await ctrl.settled(wid))["state"] == "AVAILABLE"
