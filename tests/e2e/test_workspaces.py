"""Workspaces end to end on a 3-node dev cluster whose nodes run the test VMM
(``testvmm``: the real node path, with the guest agent on the host instead of QEMU),
driven through the real ``kibo`` (spec/nodes.txt, "Which node runs a Workspace",
"Placing a Workspace on a specific node", "isolate", "retire", "drain")."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_links import remove_short_links_into

from kibotos.dev import DevCluster
from kibotos.dev.layout import write_meminfo
from kibotos.dev.procs import tail

pytestmark = pytest.mark.slow

TESTPLUGINS = Path(__file__).parents[1] / "testplugins"
NODE_ENV = {"KIBOTOS_TEST_PLUGIN_MODULES": "kibotos_testvmm",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTPLUGINS),
                                                        os.environ.get("PYTHONPATH")]))}
CLUSTER = {"vmm_backend": "testvmm", "node_env": NODE_ENV}
SMALL = ["--cpu", "0.5", "--memory", "128M", "--layer-size", "64M"]
Kibo = Callable[..., Any]


@pytest.fixture
def ws_cluster(request: pytest.FixtureRequest) -> Iterator[DevCluster]:
    """Like ``dev_cluster``, under a short directory: the guest agent's unix socket lives
    in the Instance directory, and a pytest tmp path makes it longer than sun_path's
    107 bytes."""
    marker = request.node.get_closest_marker("cluster")
    options = {"nodes": 3, "reconcile_interval": "2s", "session_timeout": "5s",
               "test_inputs": True, **(marker.kwargs if marker else {})}
    base = Path(tempfile.mkdtemp(prefix="kw", dir="/tmp"))
    cluster = DevCluster(base / "c", timeout=120)
    try:
        cluster.up(**options)
        yield cluster
    finally:
        try:
            cluster.down(grace=10)
            # `down` stops everything the cluster started, VMM units included.
            assert processes_under(base) == []
        finally:
            for svc in cluster.services():
                print(f"----- {svc.log} (last lines)\n{tail(svc.log, 40)}")
            shutil.rmtree(base, ignore_errors=True)
            remove_short_links_into(base)


def processes_under(directory: Path) -> list[str]:
    """Command lines of live processes that name a path under `directory`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = " ".join(a.decode(errors="replace") for a in argv)
        if str(directory) in text:
            found.append(f"{proc.name}: {text}")
    return found


def upload_template(cluster: DevCluster, name: str = "tiny") -> None:
    """Three blobs ctrl accepts (an ext4 superblock magic, an ELF magic) and the
    Template naming them; the test VMM does not read them."""
    blobs = {"image_digest": bytes(1080) + b"\x53\xef" + bytes(62),
             "kernel_digest": b"\x7fELF" + bytes(60), "initramfs_digest": b"initramfs"}
    body = {}
    for field, blob in blobs.items():
        hexd = hashlib.sha256(blob).hexdigest()
        cluster.api("PUT", f"/v1/artifacts/sha256/{hexd}", content=blob)
        body[field] = f"sha256:{hexd}"
    cluster.api("PUT", f"/v1/templates/{name}", json=body)


def create(kibo_json: Kibo, cluster: DevCluster, *args: str, code: int = 0) -> Any:
    out = kibo_json(cluster, "workspace", "create", "--template", "tiny", *SMALL, *args,
                    "--timeout", "120s", code=code)
    return out["result"] if code == 0 else out["error"]


def locations(kibo_json: Kibo, cluster: DevCluster, *args: str) -> list[str]:
    listed = kibo_json(cluster, "workspace", "list", *args, "--all")
    return [w["workspace_id"] for w in listed["result"]["workspaces"]]


@pytest.mark.cluster(**CLUSTER, shared_default=True)
def test_lifecycle_locations_and_move(ws_cluster: DevCluster, kibo_json: Kibo) -> None:
    cluster = ws_cluster
    upload_template(cluster)
    ws = create(kibo_json, cluster, "--node", "node-2", "--label", "team=ml")
    wid, first = ws["workspace_id"], ws["instance_id"]
    assert (ws["state"], ws["node_id"], ws["layer"]["pool_id"]) == ("AVAILABLE", "node-2",
                                                                     "shared")
    # Which node runs it: list --node, list --instance, get (Node line, --wide Instance).
    assert locations(kibo_json, cluster, "--node", "node-2") == [wid]
    assert locations(kibo_json, cluster, "--instance", first) == [wid]
    assert locations(kibo_json, cluster, "--node", "node-1") == []
    got = cluster.kibo("workspace", "get", wid, "--wide")
    assert got.returncode == 0, got.stderr
    assert "  Node:           node-2\n" in got.stdout
    assert f"  Instance:       {first}\n" in got.stdout
    quiet = cluster.kibo("workspace", "list", "--node", "node-2", "--all", "-q")
    assert quiet.stdout == f"{wid}\n"
    kibo_json(cluster, "workspace", "list", "--node", "node-9", code=12)
    assert cluster.kibo("workspace", "list", "--node", "node-2", "--state",
                        "AVAILABLE").returncode == 2
    # Already on the target: success without a stop.
    same = cluster.kibo("workspace", "move", wid, "--node", "node-2")
    assert same.returncode == 0, same.stderr
    assert "already runs on node node-2" in same.stdout
    # check -> stop -> start, with derived command IDs.
    moved = kibo_json(cluster, "workspace", "move", wid, "--node", "node-3", "--command-id",
                      "mv-1", "--timeout", "120s")["result"]
    assert (moved["state"], moved["node_id"]) == ("AVAILABLE", "node-3")
    assert moved["instance_id"] != first
    # The old Instance ID finds nothing; the new one and node-3 find it.
    assert locations(kibo_json, cluster, "--instance", first) == []
    assert locations(kibo_json, cluster, "--node", "node-2") == []
    assert locations(kibo_json, cluster, "--node", "node-3") == [wid]
    assert locations(kibo_json, cluster, "--instance", moved["instance_id"]) == [wid]
    # Running the same move again: its stop and start replay; it is there already.
    again = cluster.kibo("workspace", "move", wid, "--node", "node-3", "--command-id", "mv-1")
    assert again.returncode == 0, again.stderr
    # Stop, start (not remembered), delete.
    stopped = kibo_json(cluster, "workspace", "stop", wid, "--timeout", "120s")["result"]
    assert stopped["state"] == "STOPPED"
    assert stopped["instance"]["confirmed_on_disk"] is True
    assert cluster.kibo("workspace", "get", wid).stdout.count("  Node:           -\n") == 1
    cleanup = kibo_json(cluster, "workspace", "cleanup-status", wid)["result"]
    assert {i["item"]: (i["status"], i["source"]) for i in cleanup["items"]}["RUNTIME"] == (
        "RELEASED", "node")
    deleted = kibo_json(cluster, "workspace", "delete", wid, "--wait", "--timeout", "120s")
    assert deleted["result"]["state"] == "DELETED"


@pytest.mark.cluster(**CLUSTER)
def test_move_to_a_node_without_the_pool_changes_nothing(ws_cluster: DevCluster,
                                                         kibo_json: Kibo) -> None:
    cluster = ws_cluster
    upload_template(cluster)
    ws = create(kibo_json, cluster, "--node", "node-1")
    wid = ws["workspace_id"]
    err = kibo_json(cluster, "workspace", "move", wid, "--node", "node-2", code=13)["error"]
    assert "pool node-1" in err["message"]
    assert err["details"]["pool_id"] == "node-1"
    after = kibo_json(cluster, "workspace", "get", wid)["result"]
    assert (after["state"], after["node_id"], after["revision"]) == (
        "AVAILABLE", "node-1", ws["revision"])


@pytest.mark.cluster(**CLUSTER)
def test_pinned_placement_failures_and_memory_tight(ws_cluster: DevCluster,
                                                    kibo_json: Kibo, wait_until: Any) -> None:
    cluster = ws_cluster
    upload_template(cluster)
    # Drained: refused, not placed elsewhere.
    kibo_json(cluster, "node", "drain", "node-3")
    err = create(kibo_json, cluster, "--node", "node-3", code=13)
    assert "drain requested" in err["message"]
    # No capacity on the pinned node (4 cores each).
    err = create(kibo_json, cluster, "--node", "node-2", "--cpu", "4.5", code=15)
    assert "not enough free CPU" in err["message"]
    # Not attached to the pool of the writable layer (node-1's private pool).
    ws = create(kibo_json, cluster, "--node", "node-1")
    wid = ws["workspace_id"]
    kibo_json(cluster, "workspace", "stop", wid, "--timeout", "120s")
    err = kibo_json(cluster, "workspace", "start", wid, "--node", "node-2", code=13)["error"]
    assert "not attached to pool node-1" in err["message"]
    assert kibo_json(cluster, "workspace", "list")["result"]["workspaces"][0]["state"] == \
        "STOPPED"
    # Not remembered: a plain start places it as usual (only node-1 has its pool).
    started = kibo_json(cluster, "workspace", "start", wid, "--timeout", "120s")["result"]
    assert started["node_id"] == "node-1"
    # Memory tight on node-1 (node-3 is drained): the next create lands on node-2,
    # whether ctrl already heard of it or node-1 refused and ctrl tried the next node.
    write_meminfo(cluster.layout.proc_root("node-1"), total_bytes=16 << 30,
                  available_bytes=1 << 30)
    other = create(kibo_json, cluster)
    assert other["node_id"] == "node-2"
    wait_until(lambda: cluster.node("node-1")["memory_tight"], "node-1 reports memory tight")
    # Nobody left: node-2 tight too.
    write_meminfo(cluster.layout.proc_root("node-2"), total_bytes=16 << 30,
                  available_bytes=1 << 30)
    err = create(kibo_json, cluster, code=15)
    assert err["code"] == "resource_exhausted"


@pytest.mark.cluster(**CLUSTER)
def test_isolate_and_retire_effects(ws_cluster: DevCluster, kibo_json: Kibo,
                                    wait_until: Any) -> None:
    cluster = ws_cluster
    upload_template(cluster)
    on1 = create(kibo_json, cluster, "--node", "node-1")["workspace_id"]
    stopped1 = create(kibo_json, cluster, "--node", "node-1")["workspace_id"]
    kibo_json(cluster, "workspace", "stop", stopped1, "--timeout", "120s")
    on3 = create(kibo_json, cluster, "--node", "node-3")["workspace_id"]
    cluster.kill_node("node-1", signal.SIGKILL)
    wait_until(lambda: cluster.node("node-1")["status"] == "OFFLINE", "node-1 OFFLINE")
    result = kibo_json(cluster, "node", "isolate", "node-1", "--confirm-host-cannot-write")
    counts = result["result"]
    assert (counts["released_retained_layers"], counts["released_volumes"],
            counts["failed_workspaces"]) == (2, 0, 1)
    ws = kibo_json(cluster, "workspace", "get", on1)["result"]
    assert (ws["state"], ws["reason"], ws["node_id"]) == ("FAILED", "UNAVAILABLE", None)
    assert locations(kibo_json, cluster, "--node", "node-1") == []
    items = {i["item"]: (i["status"], i["source"]) for i in
             kibo_json(cluster, "workspace", "cleanup-status", on1)["result"]["items"]}
    assert items == {"RUNTIME": ("UNKNOWN", "control_plane"),
                     "VOLUME_ATTACHMENT": ("RELEASED", "control_plane"),
                     "RESIDUAL": ("UNKNOWN", "control_plane")}
    # Private pool: it starts again once node-1 is back (a new incarnation clears the
    # isolate; the node destroys what it ran).
    kibo_json(cluster, "workspace", "start", on1, code=15)
    cluster.start_node("node-1", env=NODE_ENV)
    cluster.wait_ready(["node-1"])
    wait_until(lambda: cluster.node("node-1")["placement"]["eligible"], "node-1 eligible")
    # What node-1 kept running of the isolated incarnation is destroyed by ctrl.
    wait_until(lambda: cluster.node("node-1")["latest_report"]["instance_count"] == 0,
               "node-1 destroyed the Instance it kept")
    started = kibo_json(cluster, "workspace", "start", on1, "--timeout", "120s")["result"]
    assert (started["state"], started["node_id"]) == ("AVAILABLE", "node-1")
    # Retire an isolated node: the cleanup status is RELEASED, from the control plane.
    cluster.kill_node("node-3", signal.SIGKILL)
    wait_until(lambda: cluster.node("node-3")["status"] == "OFFLINE", "node-3 OFFLINE")
    kibo_json(cluster, "node", "isolate", "node-3", "--confirm-host-cannot-write")
    kibo_json(cluster, "node", "retire", "node-3", "--yes")
    items = {i["item"]: (i["status"], i["source"]) for i in
             kibo_json(cluster, "workspace", "cleanup-status", on3)["result"]["items"]}
    assert items == dict.fromkeys(("RUNTIME", "VOLUME_ATTACHMENT", "RESIDUAL"),
                                  ("RELEASED", "control_plane"))


@pytest.mark.cluster(**CLUSTER)
def test_drain_wait_times_out_while_a_workspace_runs(ws_cluster: DevCluster,
                                                     kibo_json: Kibo) -> None:
    cluster = ws_cluster
    upload_template(cluster)
    wid = create(kibo_json, cluster, "--node", "node-1")["workspace_id"]
    proc = cluster.kibo("node", "drain", "node-1", "--wait", "--timeout", "5s")
    assert proc.returncode == 16, proc.stderr
    assert "did not reach DRAINED" in proc.stderr
    assert cluster.node("node-1")["drain_requested"] is True
    # Stop and delete the Workspace: the node empties and the drain completes.
    kibo_json(cluster, "workspace", "stop", wid, "--timeout", "120s")
    kibo_json(cluster, "workspace", "delete", wid, "--wait", "--timeout", "120s")
    done = cluster.kibo("node", "drain", "node-1", "--wait", "--timeout", "120s")
    assert done.returncode == 0, done.stderr
    assert cluster.node("node-1")["status"] == "DRAINED"
