"""Workspace networking end to end on the real ``qemu`` backend (TCG, the cached Platform
and ``kibotos-base`` Template; ``direct`` supervisor), against "the internet" of a world
of network namespaces the test makes (tests/network/netbed.py: 198.18.0.0/15 with an
HTTP, echo and DNS server, a management network, a stand-in host namespace).

One booted pair of VMs serves every case, in order:

1. a node process creates Instances A and B with networks (QEMU joins each Instance's
   namespace and opens its tap by name; the guest agent configures the NIC found by
   its MAC), A's guest opens a TCP connection to the test host, and the node is
   SIGKILLed;
2. the next node adopts both: the slot tables are rewritten and logged, A's connection
   survives and still carries data;
3. A fetches from the test host by name through the deployment resolver; it never
   reaches the host's addresses, the management network or B (which serves itself);
4. network switches of the running A, without a restart: ``deny_out`` blocks the test
   host, ``allow_out`` of one address with ``deny_out`` 0.0.0.0/0 allows only it, the
   default again reaches everything; A's guest boot is the same throughout;
5. A's policy switched to an Egress, a SOCKS5 server the test runs (microsocks, with
   username and password, in the test internet): A's TCP reaches the test host through
   it, and fails with a revision whose password the server refuses, with the server
   down, and while the egress process is SIGKILLed, until the node's supervisor starts
   the next one (a prober in the guest sees each: work, fail, work); not one packet
   leaves the host for the test host directly (a counter in the internet namespace);
6. A's policy switched to a Resolver: names resolve through its upstream; switched back
   to the default, the credentials files are gone and the egress process ends;
7. destroying both leaves no namespace, veth, address or record.

Needs root, QEMU, nftables and microsocks; skipped without them locally, a failure
under CI.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from vm_node_harness import VM_SETTINGS, qemu_config, qemu_config_text, template_blobs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "network"))
from guest_fetch import FETCH, FETCH_DEF
from node_network_harness import (
    CORP_REVISIONS,
    NETWORK,
    NODE_CREDENTIAL,
    THROUGH_UPSTREAM,
    UPSTREAM_ANSWER,
    DirectCounter,
    Stopper,
    egress_units,
    leftovers,
    require_network_tools,
    scope,
    serve_upstream,
    socket_dir,
    socks_server,
    through_corp,
    wire_egress,
    world,
)

from kibotos.config import NodeConfig
from kibotos.node.egress.wiring import NodeEgress
from kibotos.node.instances.contract import RUNNING
from kibotos.node.instances.manager import VmInstanceManager
from kibotos.node.instances.setup import build_instance_manager, supervisor_options
from kibotos.node.network import netns as ns
from kibotos.node.network import plumbing
from kibotos.node.network.enforce import REWRITTEN_LOG
from kibotos.node.storage.pools.dirs import prepare_pool_dirs
from kibotos.node.storage.pools.marker import init_pool
from kibotos.plugins import load_plugins
from kibotos.testing.fake_credentials import FakeCredentials

pytestmark = [pytest.mark.slow, pytest.mark.root]
HERE = Path(__file__).resolve().parent
DEADLINE = 600

#: Each argument ``target=answer`` fetched every 0.2 s until /run/probe.stop exists,
#: for at most 10 minutes; each change of outcome appended as a line to /run/probe.out:
#: ``ok`` when every target gave its answer, else what the first that did not gave.
PROBE = FETCH_DEF + r"""
last, deadline = None, time.monotonic() + 600
while not os.path.exists("/run/probe.stop") and time.monotonic() < deadline:
    outcome = "ok"
    for target, answer in (a.split("=", 1) for a in sys.argv[1:]):
        got = fetch(target)
        if got != answer:
            outcome = target + " " + got
            break
    if outcome != last:
        with open("/run/probe.out", "a") as out:
            out.write(outcome + "\n")
        last = outcome
    time.sleep(0.2)
"""

#: In A's guest: one TCP connection to the echo server, "connected" in /run/holder.out,
#: and once /run/holder.go exists one more round trip on it ("after: ok").
HOLDER = r"""
import os, socket, time
s = socket.create_connection(("198.18.0.1", 7), timeout=10)
s.sendall(b"before"); assert s.recv(16) == b"before"
open("/run/holder.out", "w").write("connected")
deadline = time.monotonic() + 900
while not os.path.exists("/run/holder.go") and time.monotonic() < deadline:
    time.sleep(0.2)
try:
    s.settimeout(10); s.sendall(b"after")
    result = "after: ok" if s.recv(16) == b"after" else "after: wrong echo"
except OSError as exc:
    result = "after: failed " + str(exc)
open("/run/holder.out", "w").write(result)
"""

#: In B's guest: an HTTP answer "B" on port 8080 for at most 15 minutes.
SERVER = r"""
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080)); s.listen(8); s.settimeout(1)
deadline = time.monotonic() + 900
while time.monotonic() < deadline:
    try:
        c, _ = s.accept()
    except socket.timeout:
        continue
    c.recv(4096); c.sendall(b"HTTP/1.0 200 OK\r\n\r\nB"); c.close()
"""

#: The first node: creates A and B, starts the holder in A and the server in B, says
#: "ready" and waits to be killed.
CHILD = r"""
import sys, tomllib, trio
sys.path[:0] = {paths!r}
from pathlib import Path
from kibotos.config import NodeConfig, parse
from kibotos.node.instances.setup import build_instance_manager
from kibotos.plugins import load_plugins
from vm_node_harness import VM_SETTINGS
config = parse(NodeConfig, tomllib.loads(Path({config!r}).read_text()), "child node.toml")
async def main():
    manager = build_instance_manager(config, memory_tight=lambda: False,
                                     registries=load_plugins(), settings=VM_SETTINGS)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        handlers = manager.command_handlers()
        for args in {creates!r}:
            await handlers["instance.create"](args)
        seen, states = 0, {{}}
        while len([s for s in states.values() if s in ("RUNNING", "FAILED")]) < 2:
            seen, frames = await manager.state_feed().after(seen)
            states.update((f["instance_id"], f["state"]) for f in frames)
        print("states", states, flush=True)
        for iid, script in (("inst-a", {holder!r}), ("inst-b", {server!r})):
            async with manager.launcher.guest(manager.get(iid), timeout=60) as guest:
                await guest.exec(["python3", "-c", script], on_detach="keep", stdin=False)
        async with manager.launcher.guest(manager.get("inst-a"), timeout=60) as guest:
            with trio.fail_after(300):  # the connection is open when the node is killed
                while (await guest.run(["cat", "/run/holder.out"]))[1] != b"connected":
                    await trio.sleep(0.5)
        print("ready", flush=True)
        await trio.sleep(3600)
trio.run(main)
"""


def parts(base: Path, bed: Any) -> dict[str, str]:
    return {"extra": NETWORK + f'[testing]\nnetwork_host_netns = "{bed.host}"\n',
            "node_extra": f'socket_dir = "{socket_dir(base)}"'}


def create_args(instance_id: str, template: dict[str, str]) -> dict[str, Any]:
    return {"instance_id": instance_id, "workspace_id": f"ws-{instance_id}",
            "template": template, "cpu_millis": 1000, "memory_bytes": 256 << 20,
            "layer": {"pool_id": "pool-a", "ref": f"ws-{instance_id}",
                      "capacity_bytes": 256 << 20, "epoch": 1, "create": True},
            "launch": {"hostname": instance_id, "env": {}},
            "network": {}, "network_revision": 1}


@asynccontextmanager
async def node(base: Path, config: NodeConfig, ctrl_url: str
               ) -> AsyncIterator[tuple[VmInstanceManager, NodeEgress]]:
    """The node over `base` with its egress processes, credentials from `ctrl_url`."""
    manager = build_instance_manager(config, memory_tight=lambda: False,
                                     registries=load_plugins(), settings=VM_SETTINGS)
    egress = wire_egress(base, config, manager, ctrl_url)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await nursery.start(egress.run)
        yield manager, egress
        nursery.cancel_scope.cancel()


async def run(manager: VmInstanceManager, instance_id: str, *argv: str) -> str:
    inst = manager.get(instance_id)
    assert inst is not None
    async with manager.launcher.guest(inst, timeout=60) as guest:
        status, out, err = await guest.run(list(argv))
    assert status.exit_code == 0, err
    return bytes(out).decode()


async def fetch(manager: VmInstanceManager, instance_id: str, *targets: str
                ) -> dict[str, str]:
    return dict(json.loads(await run(manager, instance_id, "python3", "-c", FETCH,
                                     *targets)))


async def switch(manager: VmInstanceManager, network: dict[str, Any], revision: int
                 ) -> dict[str, Any]:
    return await manager.command_handlers()["instance.set_network"](
        {"instance_id": "inst-a", "network": network, "revision": revision})


async def first_node(config_path: Path, creates: list[dict[str, Any]]) -> None:
    """The first node process, SIGKILLed once it said "ready"."""
    script = CHILD.format(paths=[str(HERE)], config=str(config_path), creates=creates,
                          holder=HOLDER, server=SERVER)
    env = {k: v for k, v in os.environ.items() if k != "KIBOTOS_FAILPOINTS"}
    proc = await trio.lowlevel.open_process([sys.executable, "-c", script], env=env,
                                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    seen = b""
    try:
        with trio.fail_after(DEADLINE):
            while b"ready\n" not in seen:
                chunk = await proc.stdout.receive_some()
                assert chunk, f"the first node ended: {seen.decode()}"
                seen += chunk
        assert "'inst-a': 'RUNNING'" in seen.decode(), seen
        assert "'inst-b': 'RUNNING'" in seen.decode(), seen
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL


async def test_workspace_networking_on_real_vms(platform_dir: Path, template_dir: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    require_network_tools()
    base = Path(tempfile.mkdtemp(prefix="kvn-", dir="/tmp"))
    init_pool("pool-a", base / "pool")
    prepare_pool_dirs("pool-a", base / "pool")
    with world(lifetime=2 * DEADLINE) as bed:  # the first node alone may take DEADLINE
        config = qemu_config(base, "vm network test node.toml", **parts(base, bed))
        try:
            template = template_blobs(base / "artifacts", platform_dir, template_dir)
            config_path = base / "node.toml"
            config_path.write_text(qemu_config_text(base, **parts(base, bed)))
            await first_node(config_path, [create_args("inst-a", template),
                                           create_args("inst-b", template)])
            caplog.set_level(logging.INFO, logger="kibotos.node")
            with FakeCredentials(NODE_CREDENTIAL, CORP_REVISIONS, lifetime=DEADLINE) as ctrl:
                async with node(base, config, ctrl.url) as (manager, egress):
                    await cases(manager, caplog, bed)
                    await egress_cases(manager, egress, bed, config)
                    for iid in ("inst-a", "inst-b"):  # 7. everything goes with them
                        assert await manager.command_handlers()["instance.destroy"](
                            {"instance_id": iid}) == {"destroyed": True}
                    assert manager.get("inst-a") is None
            assert ctrl.requests == [("corp", 1), ("corp", 2), ("corp", 1)]
            assert leftovers(base, bed) == []
        finally:
            sup = load_plugins().supervisor.get("direct")(supervisor_options(config))
            with trio.CancelScope(shield=True):
                for info in await sup.list(""):
                    await sup.stop(info.name, timeout=5)
            for name in plumbing.node_namespaces(scope(base)):
                ns.remove_netns(Path("/run/netns") / name)
            shutil.rmtree(base, ignore_errors=True)


async def cases(manager: VmInstanceManager, caplog: pytest.LogCaptureFixture,
                bed: Any) -> None:
    # 2. adopted after the SIGKILL: tables rewritten and logged, the connection kept
    await manager.takeover.wait_idle()
    for iid in ("inst-a", "inst-b"):
        inst = manager.get(iid)
        assert inst is not None
        assert inst.state == RUNNING, (iid, inst.state, inst.reason)
    rewritten = [r.getMessage() for r in caplog.records if REWRITTEN_LOG in r.getMessage()]
    assert sorted(m.split("instance=")[1].split()[0] for m in rewritten) == \
        ["inst-a", "inst-b"], rewritten
    assert all("netns=kibotos-" in m and "differences=" in m for m in rewritten)
    assert await run(manager, "inst-a", "cat", "/run/holder.out") == "connected"
    await run(manager, "inst-a", "touch", "/run/holder.go")
    with trio.fail_after(120):
        while (out := await run(manager, "inst-a", "cat", "/run/holder.out")) == "connected":
            await trio.sleep(1)
    assert out == "after: ok"
    boot_id = await run(manager, "inst-a", "cat", "/proc/sys/kernel/random/boot_id")

    # 3. by name through the deployment resolver; never the host, management, or B
    slots = {}
    for iid in ("inst-a", "inst-b"):
        inst = manager.get(iid)
        assert inst is not None
        slots[iid] = json.loads((inst.dir / "systemd.json").read_text())["network"]["addresses"]
    b_address = slots["inst-b"]["v4"]["guest"]
    assert (await fetch(manager, "inst-b", "127.0.0.1:8080")) == {"127.0.0.1:8080": "B"}
    got = await fetch(manager, "inst-a", "files.test:80", "www.test:80", "[2001:2::1]:80",
                      "198.18.0.2:80", "198.18.5.5:80", "10.99.0.2:80",
                      "169.254.169.254:80", f"{b_address}:8080")
    assert got["files.test:80"] == "198.18.1.1"
    assert got["www.test:80"] == "198.18.0.1"
    assert got["[2001:2::1]:80"] == "2001:2::1"
    for unreachable in ("198.18.0.2:80", "198.18.5.5:80", "10.99.0.2:80",
                        "169.254.169.254:80", f"{b_address}:8080"):
        assert got[unreachable].startswith("failed"), (unreachable, got)
    resolv = await run(manager, "inst-a", "cat", "/etc/resolv.conf")
    assert f"nameserver {slots['inst-a']['v4']['gateway']}" in resolv

    # 4. network switches of the running A, each in force when it answers
    assert await switch(manager, {"deny_out": ["198.18.0.0/15"]}, 2) == \
        {"network_revision": 2, "changed": True}
    got = await fetch(manager, "inst-a", "files.test:80", "[2001:2::1]:80")
    assert got["files.test:80"].startswith("failed"), got  # the name resolves, no more
    assert got["[2001:2::1]:80"] == "2001:2::1"
    await switch(manager, {"allow_out": ["198.18.1.1"], "deny_out": ["0.0.0.0/0", "::/0"]}, 3)
    got = await fetch(manager, "inst-a", "198.18.1.1:80", "198.18.1.2:80", "198.18.0.1:80",
                      "[2001:2::1]:80")
    assert got["198.18.1.1:80"] == "198.18.1.1"
    for blocked in ("198.18.1.2:80", "198.18.0.1:80", "[2001:2::1]:80"):
        assert got[blocked].startswith("failed"), (blocked, got)
    await switch(manager, {}, 4)
    got = await fetch(manager, "inst-a", "files.test:80", "198.18.1.2:80")
    assert got == {"files.test:80": "198.18.1.1", "198.18.1.2:80": "198.18.1.2"}
    assert await run(manager, "inst-a", "cat", "/proc/sys/kernel/random/boot_id") == boot_id
    inst = manager.get("inst-a")
    assert inst is not None
    assert inst.state == RUNNING


class Prober:
    """`PROBE` in A's guest: the outcomes it saw, in order."""

    def __init__(self, manager: VmInstanceManager) -> None:
        self.manager, self.seen = manager, 0

    async def start(self, *targets: str) -> None:
        inst = self.manager.get("inst-a")
        assert inst is not None
        async with self.manager.launcher.guest(inst, timeout=60) as guest:
            await guest.exec(["python3", "-c", PROBE, *targets], on_detach="keep",
                             stdin=False)

    async def next(self, ok: bool) -> str:
        """The first outcome after those seen so far that is ``ok`` (`ok`), or a
        failure (not `ok`); what came between is a failure when `ok`, else there is
        none."""
        with trio.fail_after(120):
            while True:
                new = (await run(self.manager, "inst-a", "sh", "-c",
                                 "cat /run/probe.out 2>/dev/null || true")
                       ).splitlines()[self.seen:]
                hits = [i for i, o in enumerate(new) if (o == "ok") == ok]
                if hits:
                    assert all(o != "ok" for o in new[:hits[0]]), new
                    self.seen += hits[0] + 1
                    return new[hits[0]]
                await trio.sleep(0.5)

    async def stop(self) -> None:
        await run(self.manager, "inst-a", "touch", "/run/probe.stop")


async def egress_cases(manager: VmInstanceManager, egress: NodeEgress, bed: Any,
                       config: NodeConfig) -> None:
    """5. and 6. on the running A (its policy so far the default, revision 4)."""
    counter = DirectCounter(bed)  # from here on, nothing may reach the test host directly
    credentials = config.storage.root / "state" / "egress-credentials"
    probe = Prober(manager)
    with socks_server(bed, "alice", "s3cret") as socks:
        assert await switch(manager, through_corp(1), 5) == \
            {"network_revision": 5, "changed": True}
        # by name through the deployment resolver, over IPv4 and IPv6
        await probe.start("files.test:80=198.18.1.1", "[2001:2::1]:80=2001:2::1")
        await probe.next(ok=True)
        await switch(manager, through_corp(2), 6)  # a password the server refuses
        await probe.next(ok=False)
        await switch(manager, through_corp(1), 7)
        await probe.next(ok=True)
        socks.stop()  # the SOCKS5 server down: fail, never direct
        await probe.next(ok=False)
        socks.start()
        await probe.next(ok=True)
        # the egress process killed: failures until the next one runs (EGRESS_TIMING)
        (unit,) = await egress_units(config)
        assert unit.main_pid is not None
        os.kill(unit.main_pid, signal.SIGKILL)
        await probe.next(ok=False)
        await probe.next(ok=True)
        (again,) = await egress_units(config)
        assert again.name != unit.name  # the next generation
        await probe.stop()
        assert counter.packets() == 0, "a connection went around the Egress"

    stopper = Stopper()
    serve_upstream(bed, stopper)
    try:
        await switch(manager, THROUGH_UPSTREAM, 8)
        assert await fetch(manager, "inst-a", "files.test", "198.18.1.1:80") == \
            {"files.test": UPSTREAM_ANSWER, "198.18.1.1:80": "198.18.1.1"}
    finally:
        stopper.stop()
    assert sorted(credentials.iterdir()) == []  # no policy references Egress corp
    assert counter.packets() > 0  # a Resolver policy has public egress: direct
    await switch(manager, {}, 9)
    with trio.fail_after(120):  # nothing references an egress process: it ends
        while await egress_units(config):
            await trio.sleep(0.5)
    assert egress.supervisor.current is None
