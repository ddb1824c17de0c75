"""The kill matrix through ctrl: a one-node dev cluster whose node runs the light test
VMM (``testvmm``) and is started with ``KIBOTOS_FAILPOINTS=<step>=kill``, so the real
``kibotos node serve`` process dies by SIGKILL at that step of a create (a start is
the create of a new Instance), a stop, or a stop with force (which destroys the
Instance); the node is started again without the failpoint, and the Workspace must
reach the state ctrl expects (AVAILABLE, STOPPED) through ctrl's own retries and
reconciliation, with one VMM at most for it (the one that ran at the kill adopted), and
none left after it stopped.  `kibo` drives everything, as an operator would."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from e2e_links import remove_short_links_into

from kibotos.dev import DevCluster
from kibotos.dev.procs import tail
from kibotos.testing.waiting import wait_until_sync

pytestmark = pytest.mark.slow

TESTPLUGINS = Path(__file__).parents[1] / "testplugins"
NODE_ENV = {"KIBOTOS_TEST_PLUGIN_MODULES": "kibotos_testvmm",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTPLUGINS),
                                                        os.environ.get("PYTHONPATH")]))}
SMALL = ["--cpu", "0.5", "--memory", "128M", "--layer-size", "64M"]
CREATE_STEPS = ["node.instance.after-objects-open", "node.instance.after-launch-record",
                "node.instance.after-unit-start", "node.instance.after-ready"]
STOP_STEPS = ["node.instance.before-stop", "node.instance.after-stop",
              "node.instance.before-object-release", "node.instance.after-object-release"]
Kibo = Callable[..., Any]


@pytest.fixture(scope="module")
def km_cluster() -> Iterator[DevCluster]:
    base = Path(tempfile.mkdtemp(prefix="kk", dir="/tmp"))
    cluster = DevCluster(base / "c", timeout=120)
    try:
        cluster.up(nodes=1, reconcile_interval="1s", session_timeout="5s",
                   test_inputs=True, vmm_backend="testvmm", node_env=NODE_ENV)
        blobs = {"image_digest": bytes(1080) + b"\x53\xef" + bytes(62),
                 "kernel_digest": b"\x7fELF" + bytes(60), "initramfs_digest": b"initramfs"}
        body = {}
        for field, blob in blobs.items():
            hexd = hashlib.sha256(blob).hexdigest()
            cluster.api("PUT", f"/v1/artifacts/sha256/{hexd}", content=blob)
            body[field] = f"sha256:{hexd}"
        cluster.api("PUT", "/v1/templates/tiny", json=body)
        yield cluster
    finally:
        try:
            cluster.down(grace=10)
            assert vmm_processes(cluster) == []
        finally:
            for svc in cluster.services():
                print(f"----- {svc.log} (last lines)\n{tail(svc.log, 40)}")
            shutil.rmtree(base, ignore_errors=True)
            remove_short_links_into(base)


def vmm_processes(cluster: DevCluster) -> list[str]:
    """Live guest processes (the test VMM's agents) of this cluster's node."""
    node_dir = cluster.layout.node_dir("node-1")
    roots = [str(node_dir.absolute() / "root")]
    roots += [str(p) for p in Path("/tmp").glob("kibotos-dev-*")
              if p.is_symlink() and Path(os.readlink(p)).is_relative_to(node_dir.absolute())]
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            text = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in "ZXx" and "--socket" in text and \
                any(f"{r}/runtime/instances/" in text for r in roots):
            found.append(f"{proc.name}: {text}")
    return found


#: The shared wait, with this file's deadline and pace (a probe runs ``kibo``).
wait_for = partial(wait_until_sync, timeout=120.0, interval=0.5)


def restart_node(cluster: DevCluster, failpoint: str | None = None) -> None:
    """Kill the node (its VMMs keep running) and start it again, with `failpoint`."""
    if "node-1" in cluster.running():
        cluster.kill_node("node-1", signal.SIGKILL)
    env = dict(NODE_ENV)
    if failpoint is not None:
        env["KIBOTOS_FAILPOINTS"] = f"{failpoint}=kill"
    cluster.start_node("node-1", env=env)
    cluster.wait_ready(["node-1"])


def killed_then_back(cluster: DevCluster, failpoint: str) -> None:
    """The node dies at `failpoint`; then it starts again without it."""
    status = cluster.wait_node_exit("node-1", timeout=120)
    assert status == -signal.SIGKILL, (failpoint, status, tail(
        cluster.node_service("node-1").log, 30))
    restart_node(cluster)


def state(kibo_json: Kibo, cluster: DevCluster, wid: str) -> dict[str, Any]:
    return kibo_json(cluster, "workspace", "get", wid)["result"]


def settle(kibo_json: Kibo, cluster: DevCluster, wid: str, want: str) -> dict[str, Any]:
    return wait_for(lambda: (ws := state(kibo_json, cluster, wid))["state"] == want and ws,
                    f"workspace {wid} {want}")


def instance_count(cluster: DevCluster) -> int:
    return int(cluster.node("node-1")["latest_report"]["instance_count"])


def finish(kibo_json: Kibo, cluster: DevCluster, wid: str) -> None:
    """Stop and delete the Workspace; nothing of it may stay running."""
    kibo_json(cluster, "workspace", "stop", wid, "--timeout", "120s")
    kibo_json(cluster, "workspace", "delete", wid, "--wait", "--timeout", "120s")
    wait_for(lambda: vmm_processes(cluster) == [], "no VMM left")
    wait_for(lambda: instance_count(cluster) == 0, "the node reports no Instance")


@pytest.mark.parametrize("step", CREATE_STEPS)
def test_node_killed_during_create(km_cluster: DevCluster, kibo_json: Kibo,
                                   step: str) -> None:
    cluster = km_cluster
    restart_node(cluster, step)
    wid = kibo_json(cluster, "workspace", "create", "--template", "tiny", *SMALL,
                    "--no-wait")["result"]["workspace_id"]
    killed_then_back(cluster, step)
    ws = settle(kibo_json, cluster, wid, "AVAILABLE")
    assert len(vmm_processes(cluster)) == 1  # one VMM: adopted or launched, never two
    assert instance_count(cluster) == 1
    assert ws["node_id"] == "node-1"
    finish(kibo_json, cluster, wid)


@pytest.mark.parametrize("force", [False, True], ids=["stop", "force-stop-destroys"])
@pytest.mark.parametrize("step", STOP_STEPS)
def test_node_killed_during_stop(km_cluster: DevCluster, kibo_json: Kibo, step: str,
                                 force: bool) -> None:
    cluster = km_cluster
    restart_node(cluster)
    wid = kibo_json(cluster, "workspace", "create", "--template", "tiny", *SMALL,
                    "--timeout", "120s")["result"]["workspace_id"]
    restart_node(cluster, step)  # the VMM keeps running; this node adopts it
    assert len(vmm_processes(cluster)) == 1
    kibo_json(cluster, "workspace", "stop", wid, "--no-wait", *(["--force"] if force else []))
    killed_then_back(cluster, step)
    settle(kibo_json, cluster, wid, "STOPPED")
    wait_for(lambda: vmm_processes(cluster) == [], "no VMM left")
    wait_for(lambda: instance_count(cluster) == 0, "the node reports no Instance")
    kibo_json(cluster, "workspace", "delete", wid, "--wait", "--timeout", "120s")
