"""Fencing by epoch with two real node processes on one shared pool directory
(spec: storage-pools-on-nfs, "Epochs and takeover").

Node A runs an Instance whose "VM" (the testvmm writer) keeps appending
sequence-numbered records to a Volume.  A is cut off with SIGSTOP; node B takes the
Workspace's layer and Volume over at epoch 2 and waits for A's receipts.  Either A is
resumed, its 5 s holder check stops its VMM and writes the receipts, and B records a
clean handoff; or A stays stopped (with its VMM: the whole host is down), and B opens
after 15 s with ``released_cleanly=false``.  No record of A may be written after B
opened.  These tests play ctrl's part by sending the node commands themselves.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import trio
from instance_harness import TESTPLUGINS, short_dir, write_template
from testvmm_guest import read_records, read_stamped

from kibotos.core import atomicfile
from kibotos.node.storage.objects import VOLUMES, PoolObjects
from kibotos.node.storage.pools.dirs import prepare_pool_dirs
from kibotos.node.storage.pools.marker import init_pool

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("fence_node_proc.py")
DEADLINE = 120
MIB = 1 << 20


class NodeProc:
    """One fence_node_proc.py process: commands in, replies and frames out."""

    def __init__(self, proc: trio.Process, base: Path) -> None:
        self.proc = proc
        self.base = base
        self.lines: list[dict[str, Any]] = []
        self.changed = trio.Event()

    async def pump(self) -> None:
        assert self.proc.stdout is not None
        buffer = b""
        while True:
            data = await self.proc.stdout.receive_some()
            if not data:
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                self.lines.append(json.loads(line))
                self.changed.set()
                self.changed = trio.Event()

    async def wait_for(self, predicate: Any) -> dict[str, Any]:
        seen = 0
        with trio.fail_after(DEADLINE):
            while True:
                for line in self.lines[seen:]:
                    if predicate(line):
                        return line
                seen = len(self.lines)
                await self.changed.wait()

    async def command(self, kind: str, args: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all(json.dumps({"kind": kind, "args": args}).encode()
                                       + b"\n")

    async def state(self, instance_id: str, state: str) -> dict[str, Any]:
        line = await self.wait_for(lambda x: "error" in x or (
            x.get("frame", {}).get("instance_id") == instance_id
            and x["frame"]["state"] == state))
        assert "error" not in line, line
        return dict(line["frame"])

    def vmm_group(self) -> int:
        """The process group of this node's one VMM unit (the direct supervisor's)."""
        units = list((self.base / "root" / "runtime" / "supervisor").glob("*.json"))
        assert len(units) == 1, units
        record = json.loads(units[0].read_text())
        return int(record.get("process_group") or record["main_pid"])


@asynccontextmanager
async def node_process(nursery: trio.Nursery, node_id: str, pool: Path,
                       receipt_wait: float = 15.0, *, base: Path | None = None,
                       failpoints: str | None = None) -> AsyncIterator[NodeProc]:
    """A node process; with `base`, a restart of the node that used it (kept after)."""
    own = base is None
    base = base or short_dir(f"kf{node_id[-1]}-")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(TESTPLUGINS), os.environ.get("PYTHONPATH", "")]))
    env.pop("KIBOTOS_FAILPOINTS", None)
    if failpoints is not None:
        env["KIBOTOS_FAILPOINTS"] = failpoints
    proc = await trio.lowlevel.open_process(
        [sys.executable, str(DRIVER), str(base), node_id, str(pool), str(receipt_wait)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    node = NodeProc(proc, base)
    nursery.start_soon(node.pump)
    try:
        await node.wait_for(lambda x: "started" in x)
        yield node
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.send_signal(signal.SIGCONT)
            if proc.stdin is not None:
                await proc.stdin.aclose()  # the driver stops its units and exits
            with trio.move_on_after(60):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            if own:
                shutil.rmtree(base, ignore_errors=True)


def create_args(node: NodeProc, instance_id: str, epoch: int, *, create: bool
                ) -> dict[str, Any]:
    template = write_template(node.base)  # the driver wrote the same blobs
    return {"instance_id": instance_id, "workspace_id": "ws-1", "template": template,
            "cpu_millis": 1000, "memory_bytes": 128 << 20,
            "layer": {"pool_id": "pool-a", "ref": "ws-1", "capacity_bytes": 16 * MIB,
                      "epoch": epoch, "create": create},
            "volumes": [{"pool_id": "pool-a", "volume_id": "vol-1", "epoch": epoch}],
            "launch": {"hostname": "box", "env": {}}}


def record(pool: Path, sub: str, kind: str = "volumes", name: str = "vol-1"
           ) -> dict[str, Any]:
    value = atomicfile.read_json(pool / kind / sub / f"{name}.json")
    assert isinstance(value, dict)
    return value


async def wait_records(block: Path, tag: str, count: int) -> None:
    with trio.fail_after(DEADLINE):
        while sum(1 for t, _ in read_records(str(block)) if t == tag) < count:
            await trio.sleep(0.05)


async def wait_holder(pool: Path, node_id: str) -> None:
    with trio.fail_after(DEADLINE):
        while True:
            try:
                if record(pool, "holders")["node_id"] == node_id:
                    return
            except FileNotFoundError:
                pass
            await trio.sleep(0.05)


@asynccontextmanager
async def shared_pool() -> AsyncIterator[Path]:
    pool = short_dir("kfp-")
    try:
        pool.chmod(0o755)  # mkdtemp's 0700: the VMM identity must traverse a pool
        init_pool("pool-a", pool, adopt=True)
        prepare_pool_dirs("pool-a", pool)
        vols = PoolObjects("pool-a", pool, VOLUMES, "node-a")  # ctrl's volume.create
        await vols.open("vol-1", 1, create_capacity=16 * MIB)
        assert vols.release("vol-1", 1, confirmed_on_disk=True)
        yield pool
    finally:
        shutil.rmtree(pool, ignore_errors=True)


def handoffs(frame: dict[str, Any]) -> dict[tuple[str, str, int], bool | None]:
    """``released_cleanly`` of each object of an ``instance_state`` frame."""
    return {(o["kind"], o["object_id"], o["epoch"]): o["released_cleanly"]
            for o in frame["objects"]}


def unix_time(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def a_records_after(block: Path, opened_at: float) -> list[tuple[str, int, float]]:
    """Records of inst-a stamped after B opened the Volume (there must be none)."""
    return [r for r in read_stamped(str(block)) if r[0] == "inst-a" and r[2] >= opened_at]


def last_stamp(block: Path, tag: str) -> float:
    return max(stamp for t, _, stamp in read_stamped(str(block)) if t == tag)


async def test_isolated_node_resumed_fences_itself_and_hands_off_cleanly() -> None:
    async with shared_pool() as pool, trio.open_nursery() as nursery:
        block = pool / "volumes" / "data" / "vol-1.ext4"
        async with node_process(nursery, "node-a", pool) as a, \
                node_process(nursery, "node-b", pool) as b:
            await a.command("instance.create", create_args(a, "inst-a", 1, create=True))
            await a.state("inst-a", "RUNNING")
            await wait_records(block, "inst-a", 5)  # A's VM keeps writing

            a.proc.send_signal(signal.SIGSTOP)  # A cut off: no session, no checks
            await b.command("instance.create", create_args(b, "inst-b", 2, create=False))
            await wait_holder(pool, "node-b")  # B took over and waits for receipts
            a_count = sum(1 for t, _ in read_records(str(block)) if t == "inst-a")
            await wait_records(block, "inst-a", a_count + 3)  # A's VMM still writes
            a.proc.send_signal(signal.SIGCONT)  # A resumed: its holder check fences
            resumed_at = time.time()

            failed = await a.state("inst-a", "FAILED")
            assert "use right was taken over" in failed["reason"]
            assert "node node-b at epoch 2" in failed["reason"]
            running = await b.state("inst-b", "RUNNING")
            await wait_records(block, "inst-b", 5)
            # What node-b tells ctrl: both handoffs were clean (docs/architecture.md).
            assert handoffs(running) == {("retained-layers", "ws-1", 2): True,
                                         ("volumes", "vol-1", 2): True}

            meta = record(pool, "metadata")
            assert (meta["holder"], meta["epoch"], meta["state"]) == ("node-b", 2, "attached")
            assert meta["handoff_clean"] is True
            assert meta["released_cleanly"] is True
            receipt = record(pool, "releases")
            assert (receipt["node_id"], receipt["epoch"], receipt["reason"]) == \
                ("node-a", 1, "taken_over")
            assert receipt["successor"] == {"node_id": "node-b", "epoch": 2}
            layer_meta = record(pool, "metadata", "retained-layers", "ws-1")
            assert layer_meta["handoff_clean"] is True  # both receipts came
            assert record(pool, "releases", "retained-layers", "ws-1")["epoch"] == 1

            # No write of A after B opened: every A record is older than B's open,
            # and in the log A's records all come before B's.
            opened_at = unix_time(meta["attached_at"])
            assert a_records_after(block, opened_at) == []
            # For the record (no timing is asserted): how long A's VM went on writing
            # after A was resumed, and when B opened.
            print(f"A's last write {last_stamp(block, 'inst-a') - resumed_at:.2f} s after "
                  f"SIGCONT; B opened {opened_at - resumed_at:.2f} s after it")
            tags = [t for t, _ in read_records(str(block))]
            first_b = tags.index("inst-b")
            assert "inst-a" not in tags[first_b:]
            assert tags[:first_b] == ["inst-a"] * first_b
        nursery.cancel_scope.cancel()


async def test_node_that_stays_stopped_gets_no_receipt_and_an_unclean_handoff() -> None:
    async with shared_pool() as pool, trio.open_nursery() as nursery:
        block = pool / "volumes" / "data" / "vol-1.ext4"
        async with node_process(nursery, "node-a", pool) as a, \
                node_process(nursery, "node-b", pool) as b:
            await a.command("instance.create", create_args(a, "inst-a", 1, create=True))
            await a.state("inst-a", "RUNNING")
            await wait_records(block, "inst-a", 5)
            vmm = a.vmm_group()
            os.killpg(vmm, signal.SIGSTOP)  # the whole host is down: node and VMM
            a.proc.send_signal(signal.SIGSTOP)
            try:
                await b.command("instance.create", create_args(b, "inst-b", 2, create=False))
                running = await b.state("inst-b", "RUNNING")  # after the 15 s wait
                # What node-b tells ctrl (the writable layer then shows UNKNOWN).
                assert handoffs(running) == {("retained-layers", "ws-1", 2): False,
                                             ("volumes", "vol-1", 2): False}
                meta = record(pool, "metadata")
                assert (meta["holder"], meta["epoch"]) == ("node-b", 2)
                assert meta["released_cleanly"] is False
                assert meta["handoff_clean"] is False
                # the receipt of the earlier release at epoch 1 went when A reopened
                assert not (pool / "volumes" / "releases" / "vol-1.json").exists()
                layer_meta = record(pool, "metadata", "retained-layers", "ws-1")
                assert layer_meta["released_cleanly"] is False
                await wait_records(block, "inst-b", 3)
                assert a_records_after(block, unix_time(meta["attached_at"])) == []
            finally:
                os.killpg(vmm, signal.SIGKILL)  # the dead host never comes back as is
        nursery.cancel_scope.cancel()


async def test_node_killed_while_fencing_writes_the_receipt_after_its_restart() -> None:
    """Crash consistency of the fence itself: node A is SIGKILLed after its holder
    check stopped the VMM and before the receipt (failpoint
    ``objects.fence.before-receipt``).  Restarted on the same storage root, it finds
    its Instance's objects taken over at its first check and writes the receipts; B,
    still waiting, records a clean handoff."""
    async with shared_pool() as pool, trio.open_nursery() as nursery:
        block = pool / "volumes" / "data" / "vol-1.ext4"
        base_a = short_dir("kfa-")
        try:
            async with node_process(nursery, "node-b", pool, receipt_wait=90) as b:
                async with node_process(nursery, "node-a", pool, base=base_a,
                                        failpoints="objects.fence.before-receipt=kill") as a:
                    await a.command("instance.create",
                                    create_args(a, "inst-a", 1, create=True))
                    await a.state("inst-a", "RUNNING")
                    await wait_records(block, "inst-a", 5)
                    await b.command("instance.create",
                                    create_args(b, "inst-b", 2, create=False))
                    with trio.fail_after(DEADLINE):
                        await a.proc.wait()  # killed by its own holder check's failpoint
                    assert a.proc.returncode == -signal.SIGKILL
                assert not (pool / "volumes" / "releases" / "vol-1.json").exists()
                for kind, name in (("volumes", "vol-1"), ("retained-layers", "ws-1")):
                    for sub in ("metadata", "holders"):
                        record(pool, sub, kind, name)  # whole, never torn
                async with node_process(nursery, "node-a", pool, base=base_a) as a2:
                    # its first holder check, within 5 s of the restart
                    await a2.wait_for(lambda x: x.get("frame", {}).get("state") == "FAILED"
                                      and "use right was taken over"
                                      in (x["frame"]["reason"] or ""))
                    await b.state("inst-b", "RUNNING")
                    receipt = record(pool, "releases")
                    assert (receipt["node_id"], receipt["epoch"]) == ("node-a", 1)
                    meta = record(pool, "metadata")
                    assert (meta["holder"], meta["epoch"], meta["handoff_clean"]) == \
                        ("node-b", 2, True)
                    assert a_records_after(block, unix_time(meta["attached_at"])) == []
        finally:
            shutil.rmtree(base_a, ignore_errors=True)
        nursery.cancel_scope.cancel()
