"""The README's first command, minus apt and the venv: ``python -m kibotos.dev.demo``
(what ``packaging/demo.sh`` runs) against a temporary directory.

One microVM boots: the first run starts a one-node qemu cluster with its two gateways,
builds ``kibotos-base``, creates a Workspace and uses it with ``kibo`` and with the E2B
SDK (through both gateways); the second run must reuse all of it and print the same
output; ``kibotos dev cluster down`` must then leave no process and no mount behind.

The Template is built into the VM tests' cache (``tests/vm/conftest.py``: the same
``$KIBOTOS_TEST_CACHE`` rule), so CI debootstraps once for both.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_links import vm_test_cache

from kibotos import config
from kibotos.dev import DevCluster

pytestmark = [pytest.mark.slow, pytest.mark.qemu]

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("qemu-system-x86_64", "debootstrap", "mkfs.ext4", "debugfs", "dpkg-deb",
         "apt-cache", "apt-get")


def vm_cache() -> Path:
    """The VM tests' build cache, or a skip (a failure under CI)."""
    return vm_test_cache(TOOLS, "the demo", "debootstrap")


def demo(directory: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kibotos.dev.demo", "--dir", str(directory),
         "--recipe", str(REPO / "packaging/template/kibotos-base.toml"),
         "--cache-dir", str(cache)],
        capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL, check=False)


def leftovers(paths: list[Path]) -> list[str]:
    """Live processes whose command line names one of `paths`, and mounts under them."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            text = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(str(p) in text for p in paths):
            found.append(f"process {proc.name}: {text}")
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1]
        if any(target.startswith(str(p)) for p in paths):
            found.append(f"mount {target}")
    return found


def test_make_demo_boots_a_workspace_and_runs_a_command(tmp_path: Path) -> None:
    cache = vm_cache()
    d = tmp_path / "demo-cluster"
    cluster = DevCluster(d)
    try:
        first = demo(d, cache)
        assert first.returncode == 0, f"stderr:\n{first.stderr}\nstdout:\n{first.stdout}"
        lines = first.stdout.splitlines()
        # Only the command's output is on stdout: uname -a, python3 --version, os-release,
        # then the E2B SDK script's three lines (kibotos/dev/demo_sdk.py).
        assert len(lines) == 6, first.stdout
        assert lines[0].startswith("Linux ws-"), lines
        assert lines[0].endswith("GNU/Linux"), lines
        assert lines[1].startswith("Python 3."), lines
        assert lines[2] == 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"', lines
        ws_id = lines[0].split()[1]  # the guest's hostname is its Workspace ID
        sid = ws_id.removeprefix("ws-")
        assert lines[3:] == [
            "e2b sdk: commands.run -> hello from the E2B SDK",
            "e2b sdk: files.read -> written through the E2B SDK",
            f"e2b sdk: GET http://8000-{sid}.kibotos.localhost/demo.txt through the "
            "Exposure gateway -> 200 written through the E2B SDK"]
        assert f"workspace {ws_id} AVAILABLE on node-1" in first.stderr
        assert cluster.node_ids() == ["node-1"]
        node = config.load(config.NodeConfig, cluster.layout.node_config("node-1"))
        assert node.vmm.backend == "qemu"

        again = demo(d, cache)
        assert again.returncode == 0, f"stderr:\n{again.stderr}"
        assert again.stdout == first.stdout
        assert "a dev cluster is already running" in again.stderr
        assert "kibotos-base: unchanged" in again.stderr
        assert f"reusing the demo Workspace {ws_id} (AVAILABLE)" in again.stderr
        listed = cluster.kibo("workspace", "list", "-q")
        assert listed.stdout.split() == [ws_id]
    finally:
        roots = [d]
        if cluster.layout.node_config("node-1").exists():
            node = config.load(config.NodeConfig, cluster.layout.node_config("node-1"))
            roots += [node.storage.root, node.node.socket_dir]
        down = subprocess.run([sys.executable, "-m", "kibotos.cli.main", "dev", "cluster",
                               "down", "--dir", str(d)], capture_output=True, text=True,
                              timeout=300, check=False)
        for root in roots[1:2]:
            if root.is_symlink():  # tmp_path's cluster: its short storage-root link
                root.unlink()
    assert down.returncode == 0, down.stderr
    assert "kibotos-vmm-" in down.stderr  # the Workspace's VMM unit was stopped
    deadline = time.monotonic() + 60
    while leftovers(roots) and time.monotonic() < deadline:
        time.sleep(0.5)  # a stopped process's /proc entry can outlive its exit briefly
    assert leftovers(roots) == []
