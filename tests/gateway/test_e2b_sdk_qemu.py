"""The official E2B SDK against the gateway and a one-node dev cluster on the ``qemu``
backend: one real microVM (TCG here) running ``kibotos-base``, shared by the cases.
What the test VMM cannot show is checked here: files written through envd are what
processes in the guest see, 8 MiB of random bytes keep their digest both ways, a watch
sees what a guest process changes, and a
paused sandbox (stopped, its writable layer kept) comes back on connect with its
files."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import CommandExitException, Sandbox
from gateway_proc import E2bSetup, e2b_cluster

from kibotos.dev import DevCluster
from kibotos.testing.waiting import wait_until_sync

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
from e2e_links import vm_test_cache

pytestmark = [pytest.mark.slow, pytest.mark.qemu]

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("qemu-system-x86_64", "debootstrap", "mkfs.ext4", "debugfs", "dpkg-deb",
         "apt-cache", "apt-get")


@pytest.fixture(scope="module")
def qemu_e2b() -> Iterator[E2bSetup]:
    cache = vm_test_cache(TOOLS, "the E2B gateway's qemu test", "debootstrap")

    def build_template(cluster: DevCluster) -> None:
        build = cluster.kibo("template", "build", "kibotos-base", "--recipe",
                             str(REPO / "packaging/template/kibotos-base.toml"),
                             "--cache-dir", str(cache), timeout=1800)
        assert build.returncode == 0, build.stderr

    with e2b_cluster("kgq", {"nodes": 1, "vmm_backend": "qemu"}, build_template,
                     {"base": "kibotos-base"}, memory_bytes=512 << 20,
                     layer_size_bytes=1 << 30) as setup:
        yield setup


def test_a_microvm_sandbox_runs_commands_moves_files_and_survives_a_pause(
        qemu_e2b: E2bSetup) -> None:
    opts = qemu_e2b.opts()
    sbx = Sandbox.create("base", envs={"GREETING": "hi from the vm"}, timeout=1800, **opts)
    try:
        assert sbx.commands.run("echo $GREETING; uname -s").stdout == \
            "hi from the vm\nLinux\n"
        with pytest.raises(CommandExitException) as failed:
            sbx.commands.run("exit 7")
        assert failed.value.exit_code == 7

        sbx.files.write("/root/notes/hello.txt", "written through envd")
        assert sbx.commands.run("cat /root/notes/hello.txt").stdout == "written through envd"
        sbx.commands.run("echo made in the guest > /root/notes/guest.txt")
        assert sbx.files.read("/root/notes/guest.txt") == "made in the guest\n"
        blob = os.urandom(8 << 20)
        sbx.files.write("/root/blob.bin", blob)
        digest = hashlib.sha256(blob).hexdigest()
        assert sbx.commands.run("sha256sum /root/blob.bin").stdout.split()[0] == digest
        back = sbx.files.read("/root/blob.bin", format="bytes")
        assert hashlib.sha256(back).hexdigest() == digest

        # A watch in the real guest (inotify through ctypes, Debian's python3): what a
        # process in the guest does is seen, below the watched directory too.
        watch = sbx.files.watch_dir("/root/notes", recursive=True)
        sbx.commands.run("mkdir /root/notes/w && echo x > /root/notes/w/y.txt")
        seen: list[tuple[str, str]] = []

        def written() -> bool | None:
            seen.extend((e.name, e.type.value) for e in watch.get_new_events())
            return ("w/y.txt", "write") in seen or None

        wait_until_sync(written, "the guest's write to be seen", timeout=120.0)
        assert seen[0] == ("w", "create")
        watch.stop()

        sbx.pause(mode="filesystem")
        assert Sandbox.get_info(sbx.sandbox_id, **opts).state.value == "paused"
        resumed = Sandbox.connect(sbx.sandbox_id, **opts)
        assert resumed.files.read("/root/notes/hello.txt") == "written through envd"
        assert resumed.commands.run("cat /root/notes/guest.txt").stdout == \
            "made in the guest\n"
    finally:
        assert sbx.kill()
