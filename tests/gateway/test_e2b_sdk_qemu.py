"""The official E2B SDK against the gateway and a one-node dev cluster on the ``qemu``
backend: one real microVM (TCG here) running ``kibotos-base``, shared by the cases.
What the test VMM cannot show is checked here: files written through envd are what
processes in the guest see, 8 MiB of random bytes keep their digest both ways, a watch
sees what a guest process changes, the network options reach the guest's real NIC,
and a paused sandbox (stopped, its writable layer kept) comes back on connect with its
files.

The node has ``[network]`` with a world of network namespaces as its uplink
(tests/network/netbed.py: "the internet" in 198.18.0.0/15, only test hosts), so the
sandbox, created with ``allow_out``/``deny_out``, reaches exactly what they allow;
then ``update_network`` gives it an ``egress_proxy`` (microsocks with username and
password in that internet): its TCP goes through it and nothing leaves directly, and a
password the proxy refuses makes every connection fail (closed, never direct)."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import CommandExitException, Sandbox
from gateway_proc import E2bSetup, e2b_cluster

from kibotos.dev import DevCluster
from kibotos.testing.waiting import wait_until_sync

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).parents[1] / "network"))
sys.path.insert(0, str(Path(__file__).parents[1] / "node"))
from e2e_links import vm_test_cache
from egressbed import SOCKS_ADDRESS, SOCKS_PORT, DirectCounter, egress_python, socks_server
from guest_fetch import FETCH
from netbed import World, network_config
from node_network_harness import world

pytestmark = [pytest.mark.slow, pytest.mark.qemu]

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("qemu-system-x86_64", "debootstrap", "mkfs.ext4", "debugfs", "dpkg-deb",
         "apt-cache", "apt-get")
#: The test internet's servers outlive a cold Template build (up to 30 minutes).
WORLD_LIFETIME = 3600.0


@pytest.fixture(scope="module")
def internet() -> Iterator[World]:
    with world(WORLD_LIFETIME) as bed:
        yield bed


@pytest.fixture(scope="module")
def qemu_e2b(internet: World) -> Iterator[E2bSetup]:
    cache = vm_test_cache(TOOLS, "the E2B gateway's qemu test", "debootstrap")
    python, environment = egress_python()
    network = network_config().model_dump(mode="json")
    testing = {"network_host_netns": str(internet.host), "egress_python": python,
               "egress_environment": environment}

    def build_template(cluster: DevCluster) -> None:
        build = cluster.kibo("template", "build", "kibotos-base", "--recipe",
                             str(REPO / "packaging/template/kibotos-base.toml"),
                             "--cache-dir", str(cache), timeout=1800)
        assert build.returncode == 0, build.stderr

    with e2b_cluster("kgq", {"nodes": 1, "vmm_backend": "qemu", "network": network,
                             "node_testing": testing}, build_template,
                     {"base": "kibotos-base"}, memory_bytes=512 << 20,
                     layer_size_bytes=1 << 30) as setup:
        yield setup


def _fetch(sbx: Sandbox, *targets: str) -> dict[str, str]:
    """What each ``host:port`` answers the guest over HTTP (``failed: …``)."""
    done = sbx.commands.run(f"python3 -c {shlex.quote(FETCH)} {' '.join(targets)}",
                            timeout=120)
    return dict(json.loads(done.stdout))


def _egresses(setup: E2bSetup) -> list[str]:
    return [e["name"] for e in setup.cluster.api("GET", "/v1/egresses")["egresses"]]


def _network_cases(sbx: Sandbox, internet: World, setup: E2bSetup) -> None:
    """The policy the sandbox was created with, then an egress proxy and a proxy that
    refuses the password, switched while it runs."""
    assert _fetch(sbx, "198.18.1.1:80", "198.18.0.1:80", "10.99.0.2:80") == {
        "198.18.1.1:80": "198.18.1.1",  # allow_out wins over deny_out
        "198.18.0.1:80": "failed: EHOSTUNREACH",  # deny_out: rejected at once
        "10.99.0.2:80": "failed: EHOSTUNREACH"}  # management network: never, whatever
    direct = DirectCounter(internet)
    proxy = {"address": f"{SOCKS_ADDRESS}:{SOCKS_PORT}", "username": "alice",
             "password": "s3cret"}
    with socks_server(internet, "alice", "s3cret"):
        sbx.update_network({"allow_internet_access": True, "egress_proxy": proxy})
        [egress] = [e for e in _egresses(setup) if e.startswith("e2b-")]
        assert _fetch(sbx, "198.18.0.1:80", "198.18.1.1:80") == {
            "198.18.0.1:80": "198.18.0.1", "198.18.1.1:80": "198.18.1.1"}
        assert direct.packets("tcp") == 0  # through microsocks, none directly
        listed = setup.cluster.api("GET", f"/v1/egresses/{egress}")
        assert listed["username"] == "alice"
        assert "s3cret" not in json.dumps(listed)
        shown = sbx.get_info().network  # the proxy as asked, never its password
        assert shown == {"egress_proxy": {"address": proxy["address"], "username": "alice"}}

        sbx.update_network({"allow_internet_access": True,
                            "egress_proxy": {**proxy, "password": "n0t-s3cret-7c1"}})
        [refused] = [e for e in _egresses(setup) if e.startswith("e2b-")]
        assert refused != egress  # the first one went with the switch
        # the egress process accepts, the proxy refuses the password: a reset
        assert _fetch(sbx, "198.18.0.1:80") == {"198.18.0.1:80": "failed: ECONNRESET"}
        assert direct.packets("tcp") == 0  # fails closed: never direct
        logs = setup.cluster.dir / "nodes" / "node-1" / "root" / "runtime" / \
            "supervisor" / "logs"
        said = "".join(p.read_text() for p in logs.glob("kibotos-egress-*.log"))
        assert "refused the username and password" in said
        assert "n0t-s3cret-7c1" not in said  # no secret in its log
        assert "s3cret" not in said


def test_a_microvm_sandbox_runs_commands_moves_files_and_survives_a_pause(
        qemu_e2b: E2bSetup, internet: World) -> None:
    opts = qemu_e2b.opts()
    sbx = Sandbox.create("base", envs={"GREETING": "hi from the vm"}, timeout=1800,
                         allow_internet_access=True,
                         network={"allow_out": ["198.18.1.1"],
                                  "deny_out": ["198.18.0.0/15"]}, **opts)
    try:
        _network_cases(sbx, internet, qemu_e2b)
        assert sbx.commands.run("echo $GREETING; uname -s").stdout == \
            "hi from the vm\nLinux\n"
        with pytest.raises(CommandExitException) as failed:
            sbx.commands.run("exit 7")
        assert failed.value.exit_code == 7
        assert sbx.commands.run("id -un; pwd", user="nobody").stdout == "nobody\n/\n"

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
    assert [e for e in _egresses(qemu_e2b) if e.startswith("e2b-")] == []
