"""spec/storage-pools-on-nfs.txt, "Moving a pool to another host" / "Epochs and
takeover", end to end: a real ctrl and two real node processes (test VMM) on one
shared pool.  node-1's host goes down with its Workspace running (the node process is
killed; its VMM, a unit of its own, is left as is and writes no receipt).  After the
isolate the Workspace starts on node-2, which waits the maximum time for node-1's
release receipt and opens anyway: ``kibo workspace get`` shows the writable layer's
handoff ``UNKNOWN``.  node-1 coming back (and its old Instance destroyed) changes
nothing; a stop and start on node-2 is a clean handoff again."""

from __future__ import annotations

import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_links import remove_short_links_into
from test_workspaces import CLUSTER, NODE_ENV, SMALL, processes_under, upload_template

from kibotos.dev import DevCluster
from kibotos.dev.procs import tail

pytestmark = pytest.mark.slow


@pytest.fixture
def handoff_cluster() -> Iterator[DevCluster]:
    """Two nodes whose default pool is one shared directory, under a short path (the
    guest agent's socket path must fit sun_path)."""
    base = Path(tempfile.mkdtemp(prefix="kh", dir="/tmp"))
    cluster = DevCluster(base / "c", timeout=120)
    try:
        cluster.up(nodes=2, reconcile_interval="2s", session_timeout="5s", test_inputs=True,
                   shared_default=True, **CLUSTER)
        yield cluster
    finally:
        try:
            cluster.down(grace=10)
            assert processes_under(base) == []
        finally:
            for svc in cluster.services():
                print(f"----- {svc.log} (last lines)\n{tail(svc.log, 40)}")
            shutil.rmtree(base, ignore_errors=True)
            remove_short_links_into(base)


def layer_handoff(cluster: DevCluster, wid: str) -> str:
    """The ``Layer handoff`` line of ``kibo workspace get``."""
    got = cluster.kibo("workspace", "get", wid)
    assert got.returncode == 0, got.stderr
    line = next(x for x in got.stdout.splitlines() if x.strip().startswith("Layer handoff:"))
    return line.split(":", 1)[1].strip()


def test_takeover_after_an_isolate_shows_unknown(handoff_cluster: DevCluster,
                                                  kibo_json: Any, wait_until: Any) -> None:
    cluster = handoff_cluster
    upload_template(cluster)
    ws = kibo_json(cluster, "workspace", "create", "--template", "tiny", *SMALL, "--node",
                   "node-1", "--timeout", "120s")["result"]
    wid = ws["workspace_id"]
    assert (ws["state"], ws["layer"]["pool_id"], ws["layer"]["handoff"]) == (
        "AVAILABLE", "shared", None)
    assert layer_handoff(cluster, wid) == "-"

    cluster.kill_node("node-1", signal.SIGKILL)
    wait_until(lambda: cluster.node("node-1")["status"] == "OFFLINE", "node-1 OFFLINE")
    kibo_json(cluster, "node", "isolate", "node-1", "--confirm-host-cannot-write")
    started = kibo_json(cluster, "workspace", "start", wid, "--timeout", "120s")["result"]
    assert (started["state"], started["node_id"]) == ("AVAILABLE", "node-2")
    wait_until(lambda: kibo_json(cluster, "workspace", "get", wid)["result"]["layer"]
               ["handoff"] == "UNKNOWN", "layer handoff UNKNOWN")
    assert layer_handoff(cluster, wid) == "UNKNOWN"

    # node-1 comes back with a new incarnation; ctrl destroys what it kept running.
    cluster.start_node("node-1", env=NODE_ENV)
    cluster.wait_ready(["node-1"])
    wait_until(lambda: cluster.node("node-1")["latest_report"]["instance_count"] == 0,
               "node-1 destroyed the Instance it kept")
    assert layer_handoff(cluster, wid) == "UNKNOWN"

    # A normal stop and start (node-2 again, or any node): a clean handoff.
    kibo_json(cluster, "workspace", "stop", wid, "--timeout", "120s")
    assert layer_handoff(cluster, wid) == "UNKNOWN"
    again = kibo_json(cluster, "workspace", "start", wid, "--timeout", "120s")["result"]
    assert again["state"] == "AVAILABLE"
    wait_until(lambda: kibo_json(cluster, "workspace", "get", wid)["result"]["layer"]
               ["handoff"] == "CLEAN", "layer handoff CLEAN")
    assert layer_handoff(cluster, wid) == "CLEAN"
