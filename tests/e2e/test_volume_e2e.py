"""Issue 5's end-to-end test, with a Volume: a one-node dev cluster with the ``qemu``
backend, a Volume created with ``kibo volume create``, a Workspace from
``kibotos-base`` with it attached (``--volume VOL:/data``), AVAILABLE, ``kibo workspace
exec`` writing a file in the writable layer and one in the Volume, stop, start, both
files still there, then delete (Workspace, then Volume) leaving no process, mount,
Instance directory or block file behind.

While it is stopped the second time, both objects are expanded (real ``e2fsck`` and
``resize2fs`` on the node) and moved from the node's private pool into the shared pool
the node is also attached to (``object.copy``, then the old copies deleted); the third
start finds both files and the larger file systems.

Two real microVM boots (TCG here); the Template is built into the VM tests' cache as
``tests/e2e/test_demo.py`` does.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_links import remove_short_links_into, vm_test_cache

from kibotos import config
from kibotos.dev import DevCluster
from kibotos.dev.procs import tail

pytestmark = [pytest.mark.slow, pytest.mark.qemu]

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("qemu-system-x86_64", "debootstrap", "mkfs.ext4", "e2fsck", "resize2fs",
         "dpkg-deb", "apt-get")
WAIT = "10m"


def _cache() -> Path:
    return vm_test_cache(TOOLS, "the Volume end-to-end test", "debootstrap, block file owners")


def kibo(cluster: DevCluster, *args: str, timeout: float = 900.0) -> Any:
    proc = cluster.kibo(*args, "--json", timeout=timeout)
    assert proc.returncode == 0, (f"kibo {' '.join(args)} exited {proc.returncode}\n"
                                  f"stdout: {proc.stdout}\nstderr: {proc.stderr}")
    return json.loads(proc.stdout)["result"]


def run(cluster: DevCluster, ws_id: str, command: str) -> str:
    proc = cluster.kibo("workspace", "exec", ws_id, "--timeout", "5m", "--", "sh", "-c",
                        command, timeout=600)
    assert proc.returncode == 0, f"exec {command!r}: {proc.returncode}\n{proc.stderr}"
    return proc.stdout


def leftovers(paths: list[Path], names: list[str]) -> list[str]:
    """Live processes naming one of `paths` or `names`, and mounts under `paths`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            text = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(n in text for n in names) and "pytest" not in text:
            found.append(f"process {proc.name}: {text}")
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1]
        if any(target.startswith(str(p)) for p in paths):
            found.append(f"mount {target}")
    return found


def test_volume_and_layer_survive_stop_start_and_delete_leaves_nothing(
        tmp_path: Path) -> None:
    cache = _cache()
    cluster = DevCluster(tmp_path / "c", timeout=180)
    try:
        cluster.up(1, vmm_backend="qemu", shared_pool=True)
        build = cluster.kibo("template", "build", "kibotos-base", "--recipe",
                             str(REPO / "packaging/template/kibotos-base.toml"),
                             "--cache-dir", str(cache), timeout=1800)
        assert build.returncode == 0, build.stderr
        node = config.load(config.NodeConfig, cluster.layout.node_config("node-1"))
        pool = cluster.layout.node_dir("node-1") / "pool"
        shared = cluster.layout.shared_pool

        vol = kibo(cluster, "volume", "create", "--size", "256M", "--timeout", WAIT)
        vid = vol["volume_id"]
        assert vol["state"] == "AVAILABLE"
        assert vol["pool_id"] == "node-1"
        assert (pool / "volumes" / "data" / f"{vid}.ext4").stat().st_size == 256 << 20

        ws = kibo(cluster, "workspace", "create", "--template", "kibotos-base",
                  "--memory", "512M", "--layer-size", "1G", "--volume", f"{vid}:/data",
                  "--timeout", WAIT)
        ws_id, ref = ws["workspace_id"], ws["layer"]["ref"]
        assert ws["state"] == "AVAILABLE"
        assert kibo(cluster, "volume", "get", vid)["workspace_id"] == ws_id
        out = run(cluster, ws_id, "grep ' /data ' /proc/mounts; "
                                  "echo in-the-layer > /root/layer.txt; "
                                  "echo in-the-volume > /data/volume.txt; sync; echo done")
        assert " /data ext4 " in out, out
        assert out.endswith("done\n"), out
        first_instance = ws["instance_id"]

        assert kibo(cluster, "workspace", "stop", ws_id, "--timeout", WAIT)["state"] \
            == "STOPPED"
        started = kibo(cluster, "workspace", "start", ws_id, "--timeout", WAIT)
        assert started["state"] == "AVAILABLE"
        assert started["instance_id"] != first_instance
        out = run(cluster, ws_id, "cat /root/layer.txt /data/volume.txt")
        assert out == "in-the-layer\nin-the-volume\n"

        second_instance = started["instance_id"]
        kibo(cluster, "workspace", "stop", ws_id, "--timeout", WAIT)
        # Expand both (the node runs e2fsck and resize2fs), then move both.
        vol = kibo(cluster, "volume", "expand", vid, "--size", "512M", "--timeout", WAIT)
        assert vol["capacity_bytes"] == 512 << 20
        layer = kibo(cluster, "workspace", "expand-layer", ws_id, "--size", "2G",
                     "--timeout", WAIT)
        assert layer["size_bytes"] == 2 << 30
        vol = kibo(cluster, "volume", "move", vid, "--pool", "shared", "--timeout", WAIT)
        assert vol["pool_id"] == "shared"
        layer = kibo(cluster, "workspace", "move-layer", ws_id, "--pool", "shared",
                     "--timeout", WAIT)
        assert layer["pool_id"] == "shared"
        assert not (pool / "volumes" / "data" / f"{vid}.ext4").exists()
        assert not (pool / "retained-layers" / "data" / f"{ref}.ext4").exists()
        assert (shared / "volumes" / "data" / f"{vid}.ext4").stat().st_size == 512 << 20
        started = kibo(cluster, "workspace", "start", ws_id, "--timeout", WAIT)
        assert started["state"] == "AVAILABLE"
        out = run(cluster, ws_id, "cat /root/layer.txt /data/volume.txt; "
                                  "df -k /data | tail -1")
        lines = out.splitlines()
        assert lines[:2] == ["in-the-layer", "in-the-volume"], out
        assert int(lines[2].split()[1]) > 400 * 1024, out  # the 512 MiB file system

        instance = started["instance_id"]
        kibo(cluster, "workspace", "stop", ws_id, "--timeout", WAIT)
        assert kibo(cluster, "workspace", "delete", ws_id, "--wait", "--timeout", WAIT)[
            "state"] == "DELETED"
        vol = kibo(cluster, "volume", "get", vid)
        assert vol["workspace_id"] is None  # the Volume outlived its Workspace
        assert (shared / "volumes" / "data" / f"{vid}.ext4").exists()
        assert kibo(cluster, "volume", "delete", vid, "--wait", "--timeout", WAIT)[
            "state"] == "DELETED"

        # Nothing of either is left: no VMM, no mount, no Instance directory, no files.
        roots = [node.storage.root.resolve(), pool, shared]
        names = [instance, second_instance, first_instance]
        deadline = time.monotonic() + 60
        while leftovers(roots, names) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert leftovers(roots, names) == []
        instances = node.storage.root / "runtime" / "instances"
        assert [n for n in names if (instances / n).exists()] == []
        for where in (pool, shared):
            for kind, name in (("volumes", vid), ("retained-layers", ref)):
                left = [p.name for sub in ("data", "metadata", "holders", "releases")
                        for p in (where / kind / sub).glob(f"{name}*")]
                assert left == [], (where, kind, left)
    finally:
        try:
            cluster.down(grace=10)
        finally:
            for svc in cluster.services():
                print(f"----- {svc.log} (last lines)\n{tail(svc.log, 60)}")
            remove_short_links_into(tmp_path)
