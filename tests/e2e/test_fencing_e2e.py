"""Issue 4's fencing scenario through ctrl (spec/storage-pools-on-nfs.txt, "Epochs and
takeover" and "Moving a pool to another host"; spec/nodes.txt, "isolate"): a real ctrl,
two real node processes whose default pool is one shared directory, the real ``kibo``.

A Workspace with a Volume runs on node-1; its test VMM (``write_records``) keeps
appending ``<instance> <seq> <unix time>`` records to the Volume's and the writable
layer's block files.  node-1's node process is frozen with SIGSTOP; ctrl sees its
session drop; the operator isolates node-1 and starts the Workspace again, which places
it on node-2 with the next epoch, and node-2 waits up to 15 s for node-1's receipts.

* Case A, node-1 resumed during the wait (its VMM went on writing all along, the danger
  the epochs fence against): its 5 s holder check stops the VMM and writes the receipts;
  node-2 opens after them, ``Layer handoff: CLEAN`` (the Volume's ``Handoff`` too), and
  no record of node-1's VMM is stamped after node-2 opened either file.
* Case B, node-1's host down (the node process and its VMM frozen): node-2 opens after
  the 15 s, both handoffs ``UNKNOWN``, ``released_cleanly=false``.  Then node-1's node
  process comes back: it stops its VMM (fenced by its holder check, or by the isolation
  ctrl tells it of) before that writes again, writes the receipts it owed, and no record
  of it is stamped after node-2 opened; ctrl's handoffs stay ``UNKNOWN``.

Both cases share one cluster; each ends with the Workspace AVAILABLE on node-2, running
commands, and no VMM of node-1 left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from e2e_links import remove_short_links_into
from test_workspaces import CLUSTER, NODE_ENV, SMALL, TESTPLUGINS, processes_under, upload_template

from kibotos.core import atomicfile
from kibotos.dev import DevCluster
from kibotos.dev.procs import tail
from kibotos.testing.waiting import wait_until_sync

if str(TESTPLUGINS) not in sys.path:  # the test VMM's record reader
    sys.path.insert(0, str(TESTPLUGINS))
from testvmm_guest import read_stamped

pytestmark = pytest.mark.slow

WAIT = 120.0


@pytest.fixture(scope="module")
def fence_cluster() -> Iterator[DevCluster]:
    """Two testvmm nodes whose default pool is one shared directory, their "VMs"
    writing records, under a short path (the guest agent's socket must fit sun_path)."""
    base = Path(tempfile.mkdtemp(prefix="kfe", dir="/tmp"))
    cluster = DevCluster(base / "c", timeout=120)
    try:
        cluster.up(nodes=2, reconcile_interval="2s", session_timeout="5s", test_inputs=True,
                   shared_default=True, vmm_options={"write_records": True}, **CLUSTER)
        upload_template(cluster)
        yield cluster
    finally:
        try:
            for pid in writers(base):  # a failed case may leave node-1's host frozen
                _signal_group(pid, signal.SIGCONT)
            if "node-1" in cluster.running():
                cluster.kill_node("node-1", signal.SIGCONT, wait=False)
            cluster.down(grace=10)
            assert processes_under(base) == []
        finally:
            for svc in cluster.services():
                print(f"----- {svc.log} (last lines)\n{tail(svc.log, 60)}")
            shutil.rmtree(base, ignore_errors=True)
            remove_short_links_into(base)


# ------------------------------------------------------------------ helpers


def kibo(cluster: DevCluster, *args: str) -> Any:
    proc = cluster.kibo(*args, "--json", timeout=WAIT + 60)
    assert proc.returncode == 0, (f"kibo {' '.join(args)} exited {proc.returncode}\n"
                                  f"stdout: {proc.stdout}\nstderr: {proc.stderr}")
    return json.loads(proc.stdout)["result"]


#: The shared wait, with this file's deadline (its waits span node restarts).
wait_until = partial(wait_until_sync, timeout=WAIT)


def writers(directory: Path, instance_id: str = "") -> list[int]:
    """PIDs of test-VMM record writers (the forked ``testvmm_guest.py`` that keeps its
    command line) under `directory`, of `instance_id` if given."""
    found = []
    for line in processes_under(directory):
        pid, _, text = line.partition(": ")
        if "testvmm_guest.py" in text and "--write" in text and (
                not instance_id or f"--tag {instance_id}" in text):
            found.append(int(pid))
    return found


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(os.getpgid(pid), sig)


def record(cluster: DevCluster, kind: str, sub: str, name: str) -> dict[str, Any]:
    value = atomicfile.read_json(cluster.layout.shared_pool / kind / sub / f"{name}.json")
    assert isinstance(value, dict)
    return value


def stamp(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def layer_handoff(cluster: DevCluster, wid: str) -> str:
    got = cluster.kibo("workspace", "get", wid)
    assert got.returncode == 0, got.stderr
    line = next(x for x in got.stdout.splitlines() if x.strip().startswith("Layer handoff:"))
    return line.split(":", 1)[1].strip()


def handoffs_are(ws: Running, state: str) -> None:
    """The writable layer's and the Volume's last handoff as ctrl shows them (ctrl
    records it from node-2's report of the open, which may follow the start's answer)."""
    wait_until(lambda: kibo(ws.cluster, "volume", "get", ws.vid)["handoff"] == state,
               f"the Volume's handoff {state}")
    wait_until(lambda: layer_handoff(ws.cluster, ws.wid) == state,
               f"Layer handoff: {state}")


class Running:
    """A Workspace with a Volume, created on node-1, its VMM writing records."""

    def __init__(self, cluster: DevCluster) -> None:
        self.cluster = cluster
        vol = kibo(cluster, "volume", "create", "--size", "64M", "--timeout", "120s")
        self.vid = vol["volume_id"]
        assert vol["pool_id"] == "shared"
        ws = kibo(cluster, "workspace", "create", "--template", "tiny", *SMALL, "--node",
                  "node-1", "--volume", f"{self.vid}:/data", "--timeout", "120s")
        assert (ws["state"], ws["node_id"], ws["layer"]["pool_id"]) == (
            "AVAILABLE", "node-1", "shared")
        self.wid, self.ref, self.instance = ws["workspace_id"], ws["layer"]["ref"], \
            ws["instance_id"]
        pool = cluster.layout.shared_pool
        self.blocks = [pool / "volumes" / "data" / f"{self.vid}.ext4",
                       pool / "retained-layers" / "data" / f"{self.ref}.ext4"]
        for block in self.blocks:
            wait_until(lambda b=block: self.count(b) >= 5, f"node-1's VMM writing {block}")

    def records(self, block: Path, tag: str | None = None) -> list[tuple[str, int, float]]:
        return [r for r in read_stamped(str(block)) if tag is None or r[0] == tag]

    def count(self, block: Path) -> int:
        return len(self.records(block, self.instance))

    def metadata(self) -> list[dict[str, Any]]:
        return [record(self.cluster, "volumes", "metadata", self.vid),
                record(self.cluster, "retained-layers", "metadata", self.ref)]

    def holders_are(self, node_id: str) -> bool:
        try:
            return all(record(self.cluster, kind, "holders", name)["node_id"] == node_id
                       for kind, name in (("volumes", self.vid),
                                          ("retained-layers", self.ref)))
        except FileNotFoundError:
            return False

    def isolate_and_start(self, pool: ThreadPoolExecutor) -> Future[Any]:
        """node-1 (frozen) loses its session; isolate it and start the Workspace, which
        goes to node-2 and blocks in node-2's receipt wait (returned as a future)."""
        cluster = self.cluster
        wait_until(lambda: cluster.node("node-1")["status"] == "OFFLINE", "node-1 OFFLINE")
        kibo(cluster, "node", "isolate", "node-1", "--confirm-host-cannot-write")
        started = pool.submit(kibo, cluster, "workspace", "start", self.wid, "--timeout",
                              "120s")
        wait_until(lambda: self.holders_are("node-2") or started.done(),
                   "node-2's holder records (the takeover began)")
        return started

    def after_on_node_2(self) -> None:
        """The Workspace runs on node-2, answers exec, its new VMM writes records."""
        ws = kibo(self.cluster, "workspace", "get", self.wid)
        assert (ws["state"], ws["node_id"]) == ("AVAILABLE", "node-2")
        out = self.cluster.kibo("workspace", "exec", self.wid, "--timeout", "60s", "--",
                                "sh", "-c", "echo on-node-2", timeout=WAIT)
        assert out.returncode == 0, out.stderr
        assert out.stdout == "on-node-2\n"
        for block in self.blocks:
            wait_until(lambda b=block: len(self.records(b, ws["instance_id"])) >= 3,
                       f"node-2's VMM writing {block}")
        assert writers(self.cluster.dir, self.instance) == []


def node_1_fresh(cluster: DevCluster) -> None:
    """node-1 running with a new incarnation after it was isolated (an isolated node
    exits when ctrl tells it; the dev cluster does not restart it as systemd would)."""
    if "node-1" in cluster.running():
        cluster.kill_node("node-1", signal.SIGCONT, wait=False)
        cluster.wait_node_exit("node-1", timeout=WAIT)
    cluster.start_node("node-1", env=NODE_ENV)
    cluster.wait_ready(["node-1"])


# ------------------------------------------------------------------ cases


def test_a_resumed_node_fences_itself_and_the_handoff_is_clean(
        fence_cluster: DevCluster) -> None:
    cluster = fence_cluster
    ws = Running(cluster)
    with ThreadPoolExecutor(1) as pool:
        cluster.kill_node("node-1", signal.SIGSTOP, wait=False)  # its VMM keeps writing
        started = ws.isolate_and_start(pool)
        assert not started.done(), "node-2 opened without waiting for node-1's receipts"
        before = [ws.count(b) for b in ws.blocks]
        wait_until(lambda: all(ws.count(b) > n for b, n in zip(ws.blocks, before,
                                                                 strict=True)),
                   "node-1's VMM writing while its node is frozen")
        cluster.kill_node("node-1", signal.SIGCONT, wait=False)
        resumed = time.time()
        result = started.result(timeout=WAIT + 60)
    assert (result["state"], result["node_id"]) == ("AVAILABLE", "node-2")
    handoffs_are(ws, "CLEAN")
    for meta in ws.metadata():
        assert (meta["holder"], meta["epoch"], meta["handoff_clean"],
                meta["released_cleanly"]) == ("node-2", 2, True, True), meta
        opened = stamp(meta["attached_at"])
        kind = "volumes" if meta["kind"] == "volumes" else "retained-layers"
        receipt = record(cluster, kind, "releases", meta["id"])
        assert (receipt["node_id"], receipt["epoch"]) == ("node-1", 1), receipt
        block = ws.blocks[0 if kind == "volumes" else 1]
        late = [r for r in ws.records(block, ws.instance) if r[2] >= opened]
        assert late == [], f"node-1 wrote {block.name} after node-2 opened it"
        last = max(r[2] for r in ws.records(block, ws.instance))
        print(f"{block.name}: node-1's last record {last - resumed:.2f} s after SIGCONT, "
              f"node-2 opened {opened - resumed:.2f} s after it")
    # Its holder check fenced it; ctrl's isolation rejection, which it finds when it
    # reconnects, may come first and destroy the Instance, writing the receipts the same
    # way (docs/storage.md, "The holder check").
    log = cluster.node_log("node-1")
    assert (f"holder check: release receipt written instance={ws.instance}" in log
            or f"object release skipped: another holder took it over instance={ws.instance}"
            in log), log
    ws.after_on_node_2()
    node_1_fresh(cluster)
    wait_until(lambda: cluster.node("node-1")["latest_report"]["instance_count"] == 0,
               "node-1 without its old Instance")


def test_b_a_node_that_stays_down_gets_no_receipt_and_fences_when_back(
        fence_cluster: DevCluster) -> None:
    cluster = fence_cluster
    node_1_ready = cluster.node("node-1")["status"] == "READY"
    if not node_1_ready:
        node_1_fresh(cluster)
    ws = Running(cluster)
    [vmm] = writers(cluster.dir, ws.instance)
    with ThreadPoolExecutor(1) as pool:
        _signal_group(vmm, signal.SIGSTOP)  # the whole host is down: VMM and node
        cluster.kill_node("node-1", signal.SIGSTOP, wait=False)
        started = ws.isolate_and_start(pool)
        result = started.result(timeout=WAIT + 60)  # after the 15 s wait
    assert (result["state"], result["node_id"]) == ("AVAILABLE", "node-2")
    handoffs_are(ws, "UNKNOWN")
    metas = ws.metadata()
    for meta in metas:
        assert (meta["holder"], meta["epoch"], meta["handoff_clean"],
                meta["released_cleanly"]) == ("node-2", 2, False, False), meta

    # node-1's node process comes back (its VMM stays frozen: a host cut off from
    # storage writes nothing).  node-1 fences: its holder check finds epoch 2, or ctrl's
    # isolation rejection makes it destroy its Instances and exit; either way it stops
    # the VMM, and no record of it is stamped after node-2 opened.
    cluster.kill_node("node-1", signal.SIGCONT, wait=False)
    wait_until(lambda: not writers(cluster.dir, ws.instance), "node-1's VMM stopped")
    for meta, block in zip(metas, ws.blocks, strict=True):
        late = [r for r in ws.records(block, ws.instance)
                if r[2] >= stamp(meta["attached_at"])]
        assert late == [], f"node-1 wrote {block.name} after node-2 opened it"
    # It fenced itself: the receipts it owed (too late for node-2) are there now.
    for kind, name in (("volumes", ws.vid), ("retained-layers", ws.ref)):
        receipt = wait_until(lambda k=kind, n=name: _receipt(cluster, k, n),
                             f"node-1's receipt of {name}")
        assert (receipt["node_id"], receipt["epoch"], receipt["reason"],
                receipt["successor"]) == ("node-1", 1, "taken_over",
                                          {"node_id": "node-2", "epoch": 2}), receipt
    ws.after_on_node_2()
    # node-1's return changes nothing in ctrl
    assert layer_handoff(cluster, ws.wid) == "UNKNOWN"
    assert kibo(cluster, "volume", "get", ws.vid)["handoff"] == "UNKNOWN"
    node_1_fresh(cluster)
    wait_until(lambda: cluster.node("node-1")["latest_report"]["instance_count"] == 0,
               "node-1 without its old Instance")


def _receipt(cluster: DevCluster, kind: str, name: str) -> dict[str, Any] | None:
    try:
        return record(cluster, kind, "releases", name)
    except FileNotFoundError:
        return None
