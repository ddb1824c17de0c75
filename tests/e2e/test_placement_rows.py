"""spec/nodes.txt row by row, end to end: the rows of "Which node runs a Workspace",
"Placing a Workspace on a specific node" (with the `workspace move` table), "drain",
"isolate", "retire" and "overcommit" that tests/e2e/test_workspaces.py leaves out (the
index is docs/nodes-spec-coverage.md).

One dev cluster serves the whole module (3 nodes running the test VMM, the shared pool
every node's default pool so Workspaces can change nodes); each test deletes the
Workspaces it made, and the tests that change a node for good (isolate, retire) run
last.  The nodes run with a failpoint that holds every ``object.copy`` for 20 seconds
before its rename, so a writable layer stays "being moved" long enough for `workspace
move` to meet it (only the move-check test copies anything).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_links import remove_short_links_into

from kibotos.core import ids
from kibotos.dev import DevCluster
from kibotos.dev.cluster import script
from kibotos.dev.layout import write_meminfo
from kibotos.dev.procs import tail

pytestmark = pytest.mark.slow

TESTPLUGINS = Path(__file__).parents[1] / "testplugins"
NODE_ENV = {"KIBOTOS_TEST_PLUGIN_MODULES": "kibotos_testvmm",
            "KIBOTOS_FAILPOINTS": "node.copy.before-rename=sleep:20",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTPLUGINS),
                                                        os.environ.get("PYTHONPATH")]))}
SMALL = ["--cpu", "0.5", "--memory", "128M", "--layer-size", "64M"]
GiB = 2**30
Kibo = Callable[..., Any]


@pytest.fixture(scope="module")
def rows_cluster() -> Iterator[DevCluster]:
    """One cluster for the module, under a short /tmp directory (the guest agent's unix
    socket lives in the Instance directory; a pytest tmp path is too long for it)."""
    base = Path(tempfile.mkdtemp(prefix="kr", dir="/tmp"))
    cluster = DevCluster(base / "c", timeout=120)
    try:
        cluster.up(nodes=3, reconcile_interval="2s", session_timeout="5s", test_inputs=True,
                   vmm_backend="testvmm", node_env=NODE_ENV, shared_default=True)
        upload_template(cluster)
        yield cluster
    finally:
        try:
            cluster.down(grace=10)
        finally:
            for svc in cluster.services():
                print(f"----- {svc.log} (last lines)\n{tail(svc.log, 40)}")
            shutil.rmtree(base, ignore_errors=True)
            remove_short_links_into(base)


def upload_template(cluster: DevCluster) -> None:
    """Three blobs ctrl accepts (an ext4 superblock magic, an ELF magic) and the
    Template ``tiny`` naming them; the test VMM does not read them."""
    blobs = {"image_digest": bytes(1080) + b"\x53\xef" + bytes(62),
             "kernel_digest": b"\x7fELF" + bytes(60), "initramfs_digest": b"initramfs"}
    body = {}
    for field, blob in blobs.items():
        hexd = hashlib.sha256(blob).hexdigest()
        cluster.api("PUT", f"/v1/artifacts/sha256/{hexd}", content=blob)
        body[field] = f"sha256:{hexd}"
    cluster.api("PUT", "/v1/templates/tiny", json=body)


def create(kibo_json: Kibo, c: DevCluster, *args: str, code: int = 0) -> Any:
    out = kibo_json(c, "workspace", "create", "--template", "tiny", *SMALL, *args,
                    "--timeout", "120s", code=code)
    return out["result"] if code == 0 else out["error"]


def ws(c: DevCluster, wid: str) -> dict[str, Any]:
    got = c.api("GET", f"/v1/workspaces/{wid}")
    assert isinstance(got, dict)
    return got


def listed(kibo_json: Kibo, c: DevCluster, *args: str) -> list[str]:
    out = kibo_json(c, "workspace", "list", *args, "--all")
    return [w["workspace_id"] for w in out["result"]["workspaces"]]


def all_ids(kibo_json: Kibo, c: DevCluster) -> set[str]:
    return set(listed(kibo_json, c))


def remove(kibo_json: Kibo, c: DevCluster, *wids: str) -> None:
    """Stop (if it runs) and delete each Workspace, so the next test starts empty."""
    for wid in wids:
        state = ws(c, wid)["state"]
        if state == "DELETED":
            continue
        if state not in ("STOPPED", "FAILED"):
            kibo_json(c, "workspace", "stop", wid, "--timeout", "120s")
        kibo_json(c, "workspace", "delete", wid, "--wait", "--timeout", "120s")


def run_ok(c: DevCluster, *args: str) -> str:
    proc = c.kibo(*args)
    assert proc.returncode == 0, f"kibo {' '.join(args)}: {proc.returncode}\n{proc.stderr}"
    return proc.stdout


# ------------------------------------------------------------ Which node runs a Workspace


def test_list_and_get_rows(rows_cluster: DevCluster, kibo_json: Kibo,
                           kibo_table: Callable[[str], dict[str, dict[str, str]]]) -> None:
    c = rows_cluster
    a = create(kibo_json, c, "--node", "node-1")
    b = create(kibo_json, c, "--node", "node-1")
    # `list --node`: all Workspaces executing on the node.
    assert set(listed(kibo_json, c, "--node", "node-1")) == {a["workspace_id"],
                                                              b["workspace_id"]}
    # The table is a plain list's; --wide adds INSTANCE and NODE.
    plain = kibo_table(run_ok(c, "workspace", "list", "--node", "node-1"))
    wide = kibo_table(run_ok(c, "workspace", "list", "--node", "node-1", "--wide"))
    everything = kibo_table(run_ok(c, "workspace", "list"))
    assert list(plain[a["workspace_id"]]) == list(everything[a["workspace_id"]])
    assert "INSTANCE" not in plain[a["workspace_id"]]
    assert "NODE" not in plain[a["workspace_id"]]
    row = wide[a["workspace_id"]]
    assert (row["INSTANCE"], row["NODE"]) == (a["instance_id"], "node-1")
    # Stopped: no node, not listed, `get` shows `-`; its last Instance ID finds nothing,
    # the same as an ID that never existed.
    kibo_json(c, "workspace", "stop", b["workspace_id"], "--timeout", "120s")
    assert listed(kibo_json, c, "--node", "node-1") == [a["workspace_id"]]
    assert listed(kibo_json, c, "--instance", b["instance_id"]) == []
    assert listed(kibo_json, c, "--instance", ids.new_id("inst")) == []
    got = run_ok(c, "workspace", "get", b["workspace_id"], "--wide")
    assert "  Node:           -\n" in got
    # Each start is a new Instance; the old ID still finds nothing, the new one finds it.
    again = kibo_json(c, "workspace", "start", b["workspace_id"], "--node", "node-1",
                      "--timeout", "120s")["result"]
    assert again["instance_id"] not in (None, b["instance_id"])
    assert listed(kibo_json, c, "--instance", b["instance_id"]) == []
    assert listed(kibo_json, c, "--instance", again["instance_id"]) == [b["workspace_id"]]
    # --label is a filter too: not combinable with --node or --instance (usage, 2).
    assert c.kibo("workspace", "list", "--instance", a["instance_id"], "--label",
                  "k=v").returncode == 2
    assert c.kibo("workspace", "list", "--instance", a["instance_id"], "--node",
                  "node-1").returncode == 2
    remove(kibo_json, c, a["workspace_id"], b["workspace_id"])


# ------------------------------------------------------------ Placing on a specific node


def test_pinned_placement_rows(rows_cluster: DevCluster, kibo_json: Kibo) -> None:
    c = rows_cluster
    before = all_ids(kibo_json, c)
    # A drain blocks a pinned create; nothing is placed anywhere else.
    kibo_json(c, "node", "drain", "node-2")
    err = create(kibo_json, c, "--node", "node-2", code=13)
    assert "drain requested" in err["message"]
    assert all_ids(kibo_json, c) == before
    # Smoke-testing the node: cancel its drain, then pin.
    kibo_json(c, "node", "cancel-drain", "node-2")
    pinned = create(kibo_json, c, "--node", "node-2")
    wid = pinned["workspace_id"]
    assert (pinned["node_id"], pinned["layer"]["pool_id"]) == ("node-2", "shared")
    # Not enough memory left on the pinned node (8 GiB): refused, nothing placed.
    err = create(kibo_json, c, "--node", "node-2", "--memory", "9G", code=15)
    assert "not enough free memory" in err["message"]
    assert all_ids(kibo_json, c) == before | {wid}
    # `start --node` pins a start.
    kibo_json(c, "workspace", "stop", wid, "--timeout", "120s")
    started = kibo_json(c, "workspace", "start", wid, "--node", "node-3",
                        "--timeout", "120s")["result"]
    assert (started["state"], started["node_id"]) == ("AVAILABLE", "node-3")
    # The node is not remembered: with node-3 drained, a plain start goes elsewhere.
    kibo_json(c, "workspace", "stop", wid, "--timeout", "120s")
    kibo_json(c, "node", "drain", "node-3")
    try:
        plain = kibo_json(c, "workspace", "start", wid, "--timeout", "120s")["result"]
        assert plain["state"] == "AVAILABLE"
        assert plain["node_id"] in ("node-1", "node-2")
    finally:
        kibo_json(c, "node", "cancel-drain", "node-3")
    remove(kibo_json, c, wid)


# ------------------------------------------------------------ drain --wait


def test_drain_wait_ends_13_when_the_drain_is_cancelled(rows_cluster: DevCluster,
                                                        kibo_json: Kibo,
                                                        wait_until: Any) -> None:
    c = rows_cluster
    wid = create(kibo_json, c, "--node", "node-1")["workspace_id"]
    env = {**os.environ, "KIBO_CONFIG": str(c.layout.kibo_config)}
    waiting = subprocess.Popen([script("kibo"), "node", "drain", "node-1", "--wait",
                                "--timeout", "120s"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: c.node("node-1")["status"] == "DRAINING", "node-1 DRAINING")
        # A drain does not move or stop what runs.
        assert ws(c, wid)["state"] == "AVAILABLE"
        kibo_json(c, "node", "cancel-drain", "node-1")
        _, err = waiting.communicate(timeout=120)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.communicate()
    assert waiting.returncode == 13, err
    assert "cancelled" in err
    assert c.node("node-1")["status"] == "READY"
    remove(kibo_json, c, wid)


# ------------------------------------------------------------ overcommit


def test_ratio_below_the_allocation_keeps_what_runs(rows_cluster: DevCluster,
                                                     kibo_json: Kibo, wait_until: Any) -> None:
    c = rows_cluster
    wid = create(kibo_json, c, "--node", "node-2", "--cpu", "1")["workspace_id"]
    lowered = kibo_json(c, "node", "overcommit", "set", "node-2", "--cpu", "0.1")["result"]
    assert lowered["schedulable"]["cpu_millis"] == 400  # below the 1 core allocated
    try:
        wait_until(lambda: c.node("node-2")["overcommit"]["confirmed"], "node-2 confirms")
        # No new Workspace there, pinned or not; the one that runs keeps running.
        err = create(kibo_json, c, "--node", "node-2", "--cpu", "0.1", code=15)
        assert "not enough free CPU" in err["message"]
        assert ws(c, wid)["state"] == "AVAILABLE"
        assert listed(kibo_json, c, "--node", "node-2") == [wid]
    finally:
        kibo_json(c, "node", "overcommit", "set", "node-2", "--cpu", "default")
    wait_until(lambda: c.node("node-2")["placement"]["eligible"], "node-2 placeable again")
    again = create(kibo_json, c, "--node", "node-2", "--cpu", "0.1")["workspace_id"]
    remove(kibo_json, c, wid, again)


def test_memory_tight_leaves_running_workspaces_alone(rows_cluster: DevCluster,
                                                      kibo_json: Kibo,
                                                      wait_until: Any) -> None:
    c = rows_cluster
    running = create(kibo_json, c, "--node", "node-1")["workspace_id"]
    proc = c.layout.proc_root("node-1")
    write_meminfo(proc, total_bytes=16 * GiB, available_bytes=1 * GiB)
    try:
        # The fullest node (binpack) is node-1, now tight: the create goes elsewhere,
        # whether ctrl heard of it first or node-1 refused and ctrl tried the next node.
        other = create(kibo_json, c)
        assert other["node_id"] in ("node-2", "node-3")
        # Pinned to the tight node: refused, not placed elsewhere.
        err = create(kibo_json, c, "--node", "node-1", code=15)
        assert err["code"] == "resource_exhausted"
        wait_until(lambda: c.node("node-1")["memory_tight"], "node-1 reports memory tight")
        # Existing Workspaces are not affected.
        assert ws(c, running)["state"] == "AVAILABLE"
        assert listed(kibo_json, c, "--node", "node-1") == [running]
    finally:
        write_meminfo(proc, total_bytes=16 * GiB, available_bytes=12 * GiB)
    wait_until(lambda: c.node("node-1")["placement"]["eligible"], "node-1 no longer tight",
               timeout=120)
    # Back above 15 %: node-1 takes new Workspaces again.  (The hint a refusal left in
    # placement's index clears when the report's commit reaches it, a moment after the
    # stored record; a refused pinned create writes nothing, so it is simply retried.)

    def pinned_create() -> dict[str, Any] | None:
        proc = c.kibo("workspace", "create", "--template", "tiny", *SMALL, "--node",
                      "node-1", "--timeout", "120s", "--json")
        assert proc.returncode in (0, 15), proc.stderr
        return json.loads(proc.stdout)["result"] if proc.returncode == 0 else None

    back = wait_until(pinned_create, "a create pinned to node-1")
    assert back["node_id"] == "node-1"
    remove(kibo_json, c, running, other["workspace_id"], back["workspace_id"])


# ------------------------------------------------------------ workspace move


def test_move_check_refuses_an_object_being_moved(rows_cluster: DevCluster, kibo_json: Kibo,
                                                  wait_until: Any) -> None:
    c = rows_cluster
    made = create(kibo_json, c, "--node", "node-1")
    wid = made["workspace_id"]
    kibo_json(c, "workspace", "stop", wid, "--timeout", "120s")
    revision = ws(c, wid)["revision"]
    # Copy the layer from the shared pool into node-1's own pool (held at the rename).
    kibo_json(c, "workspace", "move-layer", wid, "--pool", "node-1", "--no-wait")
    err = kibo_json(c, "workspace", "move", wid, "--node", "node-1", code=13)["error"]
    assert "being moved" in err["message"]
    after = ws(c, wid)
    assert (after["state"], after["revision"]) == ("STOPPED", revision)

    def layer_settled() -> dict[str, Any] | None:
        layer = c.api("GET", f"/v1/workspaces/{wid}/layer")
        return layer if layer.get("operation") is None else None

    layer = wait_until(layer_settled, "the layer copy to finish", timeout=120)
    assert layer["pool_id"] == "node-1"
    # Now in node-1's own pool: node-2 cannot reach it (Check row), node-1 starts it
    # (a STOPPED Workspace: no stop, only the start).
    err = kibo_json(c, "workspace", "move", wid, "--node", "node-2", code=13)["error"]
    assert err["details"]["pool_id"] == "node-1"
    moved = kibo_json(c, "workspace", "move", wid, "--node", "node-1",
                      "--timeout", "120s")["result"]
    assert (moved["state"], moved["node_id"]) == ("AVAILABLE", "node-1")
    remove(kibo_json, c, wid)


def test_move_rerun_continues_with_the_suffixed_command_ids(rows_cluster: DevCluster,
                                                             kibo_json: Kibo,
                                                             wait_until: Any) -> None:
    c = rows_cluster
    made = create(kibo_json, c, "--node", "node-1")
    wid = made["workspace_id"]
    # node-1 cannot answer: the move's stop is accepted but does not finish in time.
    c.kill_node("node-1", signal.SIGSTOP)
    try:
        cut = c.kibo("workspace", "move", wid, "--node", "node-2", "--command-id", "mv-r",
                     "--timeout", "3s")
        assert cut.returncode == 16, cut.stderr
        assert ws(c, wid)["state"] == "STOPPING"
    finally:
        c.kill_node("node-1", signal.SIGCONT)
    # The stop went out as mv-r/stop: the same ID with other input is refused.
    other = kibo_json(c, "workspace", "stop", wid, "--force", "--command-id", "mv-r/stop",
                      code=14)["error"]
    assert other["code"] == "already_exists"
    assert other["details"]["operation"] == "workspace.stop"
    # Running the same move again continues: it waits out the stop and starts.
    moved = kibo_json(c, "workspace", "move", wid, "--node", "node-2", "--command-id", "mv-r",
                      "--timeout", "120s")["result"]
    assert (moved["state"], moved["node_id"]) == ("AVAILABLE", "node-2")
    assert moved["instance_id"] != made["instance_id"]
    # The start went out as mv-r/start: replaying it starts nothing new.
    replay = kibo_json(c, "workspace", "start", wid, "--node", "node-2", "--command-id",
                       "mv-r/start", "--no-wait")["result"]
    assert replay["instance_id"] == moved["instance_id"]
    other = kibo_json(c, "workspace", "start", wid, "--node", "node-3", "--command-id",
                      "mv-r/start", code=14)["error"]
    assert other["details"]["operation"] == "workspace.start"
    assert ws(c, wid)["instance_id"] == moved["instance_id"]
    # And once more: it is there already, nothing is stopped.
    again = kibo_json(c, "workspace", "move", wid, "--node", "node-2", "--command-id", "mv-r",
                      "--timeout", "120s")["result"]
    assert again["instance_id"] == moved["instance_id"]
    remove(kibo_json, c, wid)


def test_move_start_failure_names_the_start_command(rows_cluster: DevCluster,
                                                    kibo_json: Kibo) -> None:
    c = rows_cluster
    wid = create(kibo_json, c, "--node", "node-1")["workspace_id"]
    kibo_json(c, "node", "drain", "node-3")  # the check passes; the start cannot
    try:
        proc = c.kibo("workspace", "move", wid, "--node", "node-3", "--timeout", "120s")
        assert proc.returncode == 13, proc.stderr
        assert f"kibo workspace start {wid} --node node-3" in proc.stderr
        assert ws(c, wid)["state"] == "STOPPED"  # no longer running
    finally:
        kibo_json(c, "node", "cancel-drain", "node-3")
    started = kibo_json(c, "workspace", "start", wid, "--node", "node-3",
                        "--timeout", "120s")["result"]
    assert (started["state"], started["node_id"]) == ("AVAILABLE", "node-3")
    remove(kibo_json, c, wid)


def guest_pids(c: DevCluster, node_id: str) -> list[int]:
    """The test VMM's guests (the guest agent on the host) of `node_id`: their working
    directory is an Instance directory under the node's root."""
    root = c.layout.node_dir(node_id).resolve()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            text = (proc / "cmdline").read_bytes().decode(errors="replace")
            cwd = Path(os.readlink(proc / "cwd")).resolve()
        except OSError:
            continue
        if "guest/agent.py" in text and cwd.is_relative_to(root):
            found.append(int(proc.name))
    return found


def test_move_of_a_failed_workspace_on_its_own_node(rows_cluster: DevCluster,
                                                    kibo_json: Kibo,
                                                    wait_until: Any) -> None:
    """A FAILED Workspace keeps its node until `stop --force`; moving it there is not
    "already runs there" (it does not run): the start is refused naming the force stop."""
    c = rows_cluster
    made = create(kibo_json, c, "--node", "node-1")
    wid = made["workspace_id"]
    assert listed(kibo_json, c, "--node", "node-1") == [wid]
    pids = guest_pids(c, "node-1")
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)  # the VMM exits unexpectedly
    failed = wait_until(lambda: (w := ws(c, wid))["state"] == "FAILED" and w,
                        "the Workspace FAILED")
    assert failed["node_id"] == "node-1"
    proc = c.kibo("workspace", "move", wid, "--node", "node-1", "--timeout", "120s")
    assert proc.returncode == 13, proc.stdout + proc.stderr
    assert "already runs" not in proc.stdout
    assert f"kibo workspace stop {wid} --force" in proc.stderr
    kibo_json(c, "workspace", "stop", wid, "--force", "--timeout", "120s")
    moved = kibo_json(c, "workspace", "move", wid, "--node", "node-1",
                      "--timeout", "120s")["result"]
    assert (moved["state"], moved["node_id"]) == ("AVAILABLE", "node-1")
    remove(kibo_json, c, wid)


# ------------------------------------------------------------ isolate (changes node-3)


def test_isolate_on_a_shared_pool(rows_cluster: DevCluster, kibo_json: Kibo,
                                  wait_until: Any) -> None:
    c = rows_cluster
    assert listed(kibo_json, c, "--node", "node-3") == []
    vol = kibo_json(c, "volume", "create", "--size", "64M", "--pool", "shared",
                    "--timeout", "120s")["result"]
    started = create(kibo_json, c, "--node", "node-3", "--volume",
                     f"{vol['volume_id']}:/data")["workspace_id"]
    deleted = create(kibo_json, c, "--node", "node-3")["workspace_id"]
    pending = create(kibo_json, c, "--node", "node-3")["workspace_id"]
    before = all_ids(kibo_json, c)
    # node-3 is cut off (stopped, not dead); a stop sent to it cannot complete.
    c.kill_node("node-3", signal.SIGSTOP)
    stopping = kibo_json(c, "workspace", "stop", pending, "--no-wait")["result"]
    assert stopping["state"] == "STOPPING"
    c.wait_status(["node-3"], "OFFLINE")
    # Not ready: a pinned create is refused and placed nowhere else.
    err = create(kibo_json, c, "--node", "node-3", code=13)
    assert "no live control session" in err["message"]
    assert all_ids(kibo_json, c) == before
    counts = kibo_json(c, "node", "isolate", "node-3", "--confirm-host-cannot-write",
                       )["result"]
    assert (counts["released_retained_layers"], counts["released_volumes"],
            counts["failed_workspaces"]) == (3, 1, 3)
    for wid in (started, deleted, pending):  # the pending stop failed too
        got = ws(c, wid)
        assert (got["state"], got["reason"], got["node_id"]) == ("FAILED", "UNAVAILABLE",
                                                                 None)
    assert listed(kibo_json, c, "--node", "node-3") == []
    # Shared pool: another node starts or deletes them without waiting for node-3.
    restarted = kibo_json(c, "workspace", "start", started, "--timeout", "120s")["result"]
    assert (restarted["state"], restarted["node_id"] in ("node-1", "node-2")) == (
        "AVAILABLE", True)
    assert kibo_json(c, "volume", "get", vol["volume_id"])["result"]["workspace_id"] == \
        started
    gone = kibo_json(c, "workspace", "delete", deleted, "--wait", "--timeout", "120s")
    assert gone["result"]["state"] == "DELETED"
    # `move` of a FAILED Workspace skips the stop and starts it on the target.
    moved = kibo_json(c, "workspace", "move", pending, "--node", "node-2",
                      "--timeout", "120s")["result"]
    assert (moved["state"], moved["node_id"]) == ("AVAILABLE", "node-2")
    # node-3 wakes with its isolated incarnation: rejected, it destroys its Instances
    # and exits 75; restarted (as systemd would), the isolate clears by itself.
    c.kill_node("node-3", signal.SIGCONT)
    assert c.wait_node_exit("node-3") == 75
    c.start_node("node-3", env=NODE_ENV)
    c.wait_ready(["node-3"])
    wait_until(lambda: c.node("node-3")["placement"]["eligible"], "node-3 eligible")
    # Every allocation under node-3 was released: the whole node fits one Workspace.
    whole = create(kibo_json, c, "--node", "node-3", "--cpu", "4", "--memory", "8G")
    assert whole["node_id"] == "node-3"
    remove(kibo_json, c, started, pending, whole["workspace_id"])
    kibo_json(c, "volume", "delete", vol["volume_id"], "--wait", "--timeout", "120s")


# ------------------------------------------------------------ retire (ends node-3)


def test_retire_a_drained_node_releases_in_cleanup_status(rows_cluster: DevCluster,
                                                          kibo_json: Kibo) -> None:
    c = rows_cluster
    wid = create(kibo_json, c, "--node", "node-3")["workspace_id"]
    kibo_json(c, "workspace", "stop", wid, "--timeout", "120s")
    kibo_json(c, "node", "drain", "node-3")
    c.wait_status(["node-3"], "DRAINED")
    retired = kibo_json(c, "node", "retire", "node-3", "--yes")["result"]
    assert retired["status"] == "RETIRED"
    status = kibo_json(c, "workspace", "cleanup-status", wid)["result"]
    assert status["node_id"] == "node-3"
    assert {i["item"]: (i["status"], i["source"]) for i in status["items"]} == dict.fromkeys(
        ("RUNTIME", "VOLUME_ATTACHMENT", "RESIDUAL"), ("RELEASED", "control_plane"))
    # Its layer is in the shared pool: another node starts it.
    started = kibo_json(c, "workspace", "start", wid, "--timeout", "120s")["result"]
    assert started["node_id"] in ("node-1", "node-2")
    remove(kibo_json, c, wid)
