"""The node's Instance lifecycle for real: the ``direct`` supervisor starts ``testvmm``
units whose "VM" is the real guest agent, and every step is checked against /proc, the
records on disk and the pool.  Waits are polls under generous deadlines; nothing
asserts how long anything took."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import trio
from instance_harness import DEADLINE, Node, running_node

from kibotos.core import atomicfile
from kibotos.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from kibotos.node.instances.contract import CREATING, FAILED, RUNNING, STOPPED
from kibotos.node.instances.manager import EXITED_REASON

HERE = Path(__file__).resolve().parent


def proc_stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()  # fields 3…


def alive(pid: int, start_ticks: int) -> bool:
    try:
        fields = proc_stat(pid)
    except OSError:
        return False
    return int(fields[19]) == start_ticks and fields[0] not in "ZXx"


def group_members(pgrp: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = proc_stat(int(entry))
            except OSError:
                continue
            if int(fields[2]) == pgrp and fields[0] not in "ZXx":
                out.append(int(entry))
    return out


def read(path: Path) -> dict:
    return atomicfile.read_json(path)


def text(path: str | Path) -> str:
    return Path(path).read_text()


def ext4_magic(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(1080)
        return f.read(2)


def same_file(a: Path, b: Path) -> bool:
    return os.path.samefile(a, b)


def gone(pid: int) -> bool:
    """The process ended (a zombie waiting for init counts as ended)."""
    try:
        return proc_stat(pid)[0] in "ZXx"
    except OSError:
        return True


async def start(node: Node, instance_id: str = "inst-1", **kw) -> dict:
    assert await node.command("instance.create", node.create_args(instance_id, **kw)) == \
        {"accepted": True}
    frame = await node.wait_state(instance_id, RUNNING, FAILED)
    assert frame["state"] == RUNNING, frame
    return frame


async def test_create_runs_the_vm_and_records_the_launch() -> None:
    async with running_node() as node:
        args = node.create_args()
        assert await node.command("instance.create", args) == {"accepted": True}
        creating = await node.wait_state("inst-1", CREATING)
        assert creating["workspace_id"] == "ws-1"
        running = await node.wait_state("inst-1", RUNNING, FAILED)
        assert running["state"] == RUNNING, running

        inst_dir = node.root / "runtime" / "instances" / "inst-1"
        record = read(inst_dir / "systemd.json")
        unit = record["unit"]
        pid = unit["main_pid"]
        # The launch record against /proc.
        assert record["unit_name"] == "kibotos-vmm-inst-1.service"
        assert record["launch_id"].startswith("lch-")
        assert record["expected_command"][-4:] == ["--socket", str(inst_dir / "agent.sock"),
                                                   "--root", str(inst_dir / "guestroot")]
        assert int(proc_stat(pid)[19]) == unit["start_time_ticks"]
        exe = os.readlink(f"/proc/{pid}/exe")
        st = os.stat(f"/proc/{pid}/exe")
        assert unit["executable"] == exe
        assert unit["executable_dev_ino"] == [st.st_dev, st.st_ino]
        cgroup = text(f"/proc/{pid}/cgroup")
        assert unit["cgroup"] in cgroup
        assert unit["netns_inode"] == os.stat(f"/proc/{pid}/ns/net").st_ino
        assert len(unit["invocation_id"]) == 32
        boot_id = text("/proc/sys/kernel/random/boot_id").strip()
        assert record["guest"]["boot_id"] == boot_id
        assert "stop_prepare" in record["guest"]["capabilities"]
        assert running["guest"] == {"boot_id": boot_id,
                                    "capabilities": record["guest"]["capabilities"]}
        assert record["launch"]["memory"] == 256 << 20
        assert record["launch"]["vcpus"] == 2

        # The guest was configured: its hostname, written under its root.
        assert (inst_dir / "guestroot" / "etc" / "hostname").read_text() == "box-1\n"
        inst = node.manager.get("inst-1")
        async with node.manager.launcher.guest(inst) as guest:
            status, out, _ = await guest.run(["sh", "-c", "echo $GREETING"])
        assert (status.exit_code, out) == (0, b"hi\n")

        # The writable layer: a sparse ext4 file of the capacity, held at the epoch.
        layer = node.pool / "retained-layers" / "data" / "ws-1.ext4"
        assert layer.stat().st_size == 64 << 20
        assert layer.stat().st_blocks * 512 < 64 << 20
        assert ext4_magic(layer) == b"\x53\xef"  # the ext4 superblock magic
        holder = read(node.pool / "retained-layers" / "holders" / "ws-1.json")
        assert (holder["node_id"], holder["epoch"]) == ("node-a", 1)
        meta = read(node.pool / "retained-layers" / "metadata" / "ws-1.json")
        assert (meta["id"], meta["state"], meta["capacity_bytes"]) == ("ws-1", "attached",
                                                                       64 << 20)

        held = node.manager.holdings()
        assert (held.allocated_cpu_millis, held.allocated_memory_bytes) == (1500, 256 << 20)
        assert (held.instance_count, held.volume_count) == (1, 1)
        assert held.to_wire()["instances"] == [
            {"instance_id": "inst-1", "workspace_id": "ws-1", "state": "RUNNING",
             "reason": None, "objects": [
                 {"kind": "retained-layers", "pool_id": "pool-a", "object_id": "ws-1",
                  "epoch": 1, "released_cleanly": None}]}]  # a new layer: no handoff
        cores, rss = node.manager.vm_usage()
        assert rss is not None
        assert rss > 0
        cores, rss = node.manager.vm_usage()
        assert cores is not None
        assert cores >= 0


async def test_normal_stop_keeps_the_layer_with_a_clean_release() -> None:
    async with running_node() as node:
        await start(node)
        inst = node.manager.get("inst-1")
        pid, ticks = inst.main_process
        async with node.manager.launcher.guest(inst) as guest:
            proc = await guest.exec(["sleep", "1000"], on_detach="keep", stdin=False)
            guest_pid = proc.pid
        assert alive(guest_pid, int(proc_stat(guest_pid)[19]))

        result = await node.command("instance.stop", {"instance_id": "inst-1",
                                                      "force": False, "deadline_s": 20})
        assert result == {"confirmed_on_disk": True}
        assert (await node.wait_state("inst-1", STOPPED))["reason"] is None
        assert not alive(pid, ticks)
        assert group_members(pid) == []
        assert gone(guest_pid)
        assert await node.manager.launcher.supervisor.describe(inst.unit_name) is None

        objects = node.pool / "retained-layers"
        assert (objects / "data" / "ws-1.ext4").stat().st_size == 64 << 20
        meta = read(objects / "metadata" / "ws-1.json")
        assert (meta["state"], meta["released_cleanly"], meta["confirmed_on_disk"]) == \
            ("released", True, True)
        assert read(objects / "holders" / "ws-1.json")["epoch"] == 1  # the holder stays
        assert read(objects / "releases" / "ws-1.json")["node_id"] == "node-a"
        held = node.manager.holdings()
        assert (held.instance_count, held.allocated_cpu_millis) == (0, 0)
        assert held.volume_count == 1  # a private pool: the layer is still this node's
        # The Instance ended: its directory is gone, a registry entry answers for it.
        assert not inst.dir.exists()
        assert node.manager.get("inst-1") is None
        assert held.instances == ()
        entry = read(node.root / "runtime" / "registry" / "inst-1.json")
        assert (entry["state"], entry["confirmed_on_disk"]) == (STOPPED, True)
        assert (node.root / "machine-logs" / "inst-1" / "vmm.log").is_file()

        # Idempotent: the same answer again, nothing else happens.
        assert await node.command("instance.stop", {"instance_id": "inst-1"}) == \
            {"confirmed_on_disk": True}


async def test_force_stop_is_not_confirmed_on_disk() -> None:
    async with running_node(shared=True) as node:
        await start(node)
        pid, ticks = node.manager.get("inst-1").main_process
        result = await node.command("instance.stop", {"instance_id": "inst-1", "force": True})
        assert result == {"confirmed_on_disk": False}
        assert not alive(pid, ticks)
        meta = read(node.pool / "retained-layers" / "metadata" / "ws-1.json")
        assert (meta["released_cleanly"], meta["confirmed_on_disk"]) == (True, False)
        assert node.manager.holdings().volume_count == 0  # shared pool: use right returned


async def test_failed_stop_prepare_leaves_the_vmm_running() -> None:
    async with running_node() as node:
        await start(node)
        inst = node.manager.get("inst-1")
        pid, ticks = inst.main_process
        async with node.manager.launcher.guest(inst) as guest:
            await guest.exec(["sh", "-c", "trap '' TERM; while :; do sleep 1; done"],
                             on_detach="keep", stdin=False)
        with pytest.raises(FailedPrecondition) as caught:
            await node.command("instance.stop", {"instance_id": "inst-1", "deadline_s": 1})
        assert caught.value.message.startswith("prepare guest stop: deadline_exceeded")
        failed = await node.wait_state("inst-1", FAILED)
        assert failed["reason"].startswith("prepare guest stop: deadline_exceeded")
        assert alive(pid, ticks)  # the node could not confirm the data: the VM stays
        assert node.manager.holdings().instance_count == 1

        assert await node.command("instance.stop", {"instance_id": "inst-1",
                                                    "force": True}) == \
            {"confirmed_on_disk": False}
        assert not alive(pid, ticks)


async def test_destroy_leaves_no_process_and_no_instance_directory() -> None:
    async with running_node() as node:
        await start(node)
        inst = node.manager.get("inst-1")
        pid, ticks = inst.main_process
        (inst.dir / "console.log").write_text("guest said goodbye\n")
        assert await node.command("instance.destroy", {"instance_id": "inst-1"}) == \
            {"destroyed": True}
        assert (await node.wait_state("inst-1", "DESTROYED"))["state"] == "DESTROYED"
        assert not alive(pid, ticks)
        assert group_members(pid) == []
        assert not inst.dir.exists()
        assert node.manager.get("inst-1") is None
        assert (node.pool / "retained-layers" / "data" / "ws-1.ext4").is_file()
        assert (node.root / "machine-logs" / "inst-1" / "console.log").read_text() == \
            "guest said goodbye\n"
        entry = read(node.root / "runtime" / "registry" / "inst-1.json")
        assert entry["state"] == "DESTROYED"
        held = node.manager.holdings()
        assert (held.instance_count, held.instances) == (0, ())

        # Repeats get the same answers; the destroyed ID cannot be created again.
        assert await node.command("instance.destroy", {"instance_id": "inst-1"}) == \
            {"destroyed": True}
        assert await node.command("instance.stop", {"instance_id": "inst-1"}) == \
            {"confirmed_on_disk": False}
        with pytest.raises(FailedPrecondition, match="was destroyed"):
            await node.command("instance.create", node.create_args())
        with pytest.raises(NotFound):
            await node.command("instance.stop", {"instance_id": "inst-2"})


async def test_create_is_idempotent_by_instance_id() -> None:
    async with running_node() as node:
        args = node.create_args()
        assert await node.command("instance.create", args) == {"accepted": True}
        assert await node.command("instance.create", args) == {"accepted": True}
        await node.wait_state("inst-1", RUNNING)
        invocation = read(node.manager.get("inst-1").dir / "systemd.json")["unit"]
        assert await node.command("instance.create", args) == {"accepted": True}
        assert read(node.manager.get("inst-1").dir / "systemd.json")["unit"] == invocation
        units = await node.manager.launcher.supervisor.list("kibotos-vmm-")
        assert [u.name for u in units] == ["kibotos-vmm-inst-1.service"]
        other = dict(args, cpu_millis=500)
        with pytest.raises(AlreadyExists):
            await node.command("instance.create", other)
        # The same layer cannot be opened twice on this node.
        with pytest.raises(FailedPrecondition, match="in use by Instance inst-1"):
            await node.command("instance.create", node.create_args("inst-2"))


async def test_refusals_write_nothing() -> None:
    async with running_node() as node:
        instances = node.root / "runtime" / "instances"
        node.manager.set_drain_requested(True)
        with pytest.raises(FailedPrecondition) as caught:
            await node.command("instance.create", node.create_args())
        assert caught.value.details == {"reason": "drained"}
        assert await node.command("node.drain", {"requested": False}) == \
            {"drain_requested": False}

        node.tight[0] = True
        with pytest.raises(ResourceExhausted, match="memory is tight") as caught:
            await node.command("instance.create", node.create_args())
        assert caught.value.details == {"reason": "memory_tight"}
        node.tight[0] = False

        for bad in ("../x", "Inst-1", "x" * 33, "-x", "a/b", ""):
            with pytest.raises(InvalidArgument, match="instance_id"):
                await node.command("instance.create", node.create_args(bad))
        with pytest.raises(InvalidArgument, match=r"layer\.ref"):
            await node.command("instance.create", node.create_args(ref="../../etc"))
        with pytest.raises(InvalidArgument, match="extra: unknown field"):
            await node.command("instance.create", node.create_args(extra=1))
        args = node.create_args()
        args["layer"]["pool_id"] = "pool-b"
        with pytest.raises(FailedPrecondition, match="pool-b is not configured"):
            await node.command("instance.create", args)
        assert not instances.exists() or list(instances.iterdir()) == []
        assert not (node.pool / "retained-layers" / "data").exists() or \
            list((node.pool / "retained-layers" / "data").iterdir()) == []
        assert node.manager.state_feed().position == 0


async def test_unexpected_exit_fails_with_the_spec_reason() -> None:
    async with running_node() as node:
        await start(node)
        inst = node.manager.get("inst-1")
        pid, _ticks = inst.main_process
        os.kill(pid, signal.SIGKILL)
        failed = await node.wait_state("inst-1", FAILED)
        assert failed["reason"] == EXITED_REASON
        # It keeps its resources and its layer until stopped with force or destroyed.
        held = node.manager.holdings()
        assert (held.instance_count, held.allocated_cpu_millis, held.volume_count) == \
            (1, 1500, 1)
        assert read(inst.dir / "instance.json")["reason"] == EXITED_REASON
        assert await node.command("instance.stop", {"instance_id": "inst-1",
                                                    "force": True}) == \
            {"confirmed_on_disk": False}
        assert node.manager.holdings().instance_count == 0


async def test_readiness_timeout_stops_the_unit() -> None:
    from kibotos.node.instances.lifecycle import Settings

    settings = Settings(ready_timeout=2, stop_timeout=5, force_sync_timeout=2,
                        monitor_interval=0.1)
    async with running_node(backend_options="hang = true", settings=settings) as node:
        assert await node.command("instance.create", node.create_args()) == {"accepted": True}
        failed = await node.wait_state("inst-1", FAILED, RUNNING)
        assert failed["state"] == FAILED
        assert "did not accept a connection before the deadline" in failed["reason"]
        inst = node.manager.get("inst-1")
        pid, ticks = inst.main_process
        assert not alive(pid, ticks)
        assert node.manager.holdings().instance_count == 1  # until ctrl stops it


async def test_guest_with_an_unsupported_protocol_fails_the_boot() -> None:
    async with running_node(backend_options="refuse = true") as node:
        await node.command("instance.create", node.create_args())
        failed = await node.wait_state("inst-1", FAILED, RUNNING)
        assert "guest protocol version 0 is outside" in failed["reason"]


async def test_a_vmm_that_dies_during_boot_fails_at_once() -> None:
    async with running_node(backend_options='python = "/bin/false"') as node:
        await node.command("instance.create", node.create_args())
        failed = await node.wait_state("inst-1", FAILED, RUNNING)
        assert "ended (gone) before the guest was ready" in failed["reason"]


async def test_unusable_backend_refuses_creates() -> None:
    async with running_node(backend_options='probe_error = "no hypervisor"') as node:
        with trio.fail_after(DEADLINE):
            await node.manager._probed.wait()
        with pytest.raises(FailedPrecondition, match="no hypervisor") as caught:
            await node.command("instance.create", node.create_args())
        assert caught.value.details == {"reason": "vmm_unusable"}


async def test_missing_template_blob_fails_the_boot() -> None:
    async with running_node() as node:
        args = node.create_args()
        args["template"]["kernel_digest"] = "sha256:" + "0" * 64
        await node.command("instance.create", args)
        failed = await node.wait_state("inst-1", FAILED, RUNNING)
        assert failed["reason"].startswith("template tiny: kernel sha256:000")


@pytest.fixture
def failpoint(monkeypatch: pytest.MonkeyPatch):
    """Arm failpoints in this process (``error`` actions) for one test."""
    from kibotos.core import failpoints

    def arm(spec: str) -> None:
        monkeypatch.setenv(failpoints.ENV, spec)
        failpoints.reload()

    yield arm
    monkeypatch.delenv(failpoints.ENV, raising=False)
    failpoints.reload()


@pytest.mark.parametrize("name", ["node.instance.after-launch-record",
                                  "node.instance.after-unit-start",
                                  "node.instance.after-ready"])
async def test_a_failure_at_each_launch_step_leaves_no_vmm(failpoint, name: str) -> None:
    failpoint(f"{name}=error")
    async with running_node() as node:
        await node.command("instance.create", node.create_args())
        failed = await node.wait_state("inst-1", FAILED, RUNNING)
        assert f"failpoint {name} triggered" in failed["reason"]
        inst = node.manager.get("inst-1")
        assert (inst.dir / "systemd.json").is_file()  # written before the unit started
        assert await node.manager.launcher.supervisor.list("kibotos-vmm-") == []
        if inst.main_process is not None:
            assert not alive(*inst.main_process)
        failpoint("")
        # FAILED keeps the resources until ctrl stops it with force.
        assert await node.command("instance.stop", {"instance_id": "inst-1",
                                                    "force": True}) == \
            {"confirmed_on_disk": False}
        assert node.manager.holdings().instance_count == 0


@pytest.mark.parametrize("name", ["node.instance.before-stop", "node.instance.after-stop",
                                  "node.instance.before-object-release"])
async def test_a_failure_at_each_stop_step_is_retried(failpoint, name: str) -> None:
    async with running_node() as node:
        await start(node)
        failpoint(f"{name}=error")
        with pytest.raises(OSError, match=f"failpoint {name} triggered"):
            await node.command("instance.stop", {"instance_id": "inst-1", "force": True})
        assert (await node.wait_state("inst-1", FAILED))["reason"].endswith("triggered")
        meta = read(node.pool / "retained-layers" / "metadata" / "ws-1.json")
        assert meta["state"] == "attached"  # not released while the stop failed
        failpoint("")
        assert await node.command("instance.stop", {"instance_id": "inst-1",
                                                    "force": True}) == \
            {"confirmed_on_disk": False}
        meta = read(node.pool / "retained-layers" / "metadata" / "ws-1.json")
        assert (meta["state"], meta["released_cleanly"]) == ("released", True)
        assert await node.manager.launcher.supervisor.list("kibotos-vmm-") == []


@pytest.mark.parametrize("kind", ["instance.destroy", "instance.stop"])
async def test_destroy_or_force_stop_while_booting(kind: str) -> None:
    async with running_node(backend_options="hang = true") as node:
        await node.command("instance.create", node.create_args())
        with trio.fail_after(DEADLINE):  # the unit runs; its guest never answers
            while node.manager.get("inst-1").main_process is None:
                await trio.sleep(0.05)
        inst = node.manager.get("inst-1")
        pid, ticks = inst.main_process
        args = {"instance_id": "inst-1"} if kind == "instance.destroy" else \
            {"instance_id": "inst-1", "force": True}
        await node.command(kind, args)
        assert not alive(pid, ticks)
        assert node.manager.get("inst-1") is None
        assert not inst.dir.exists()
        states = [f["state"] for f in (await node.manager.state_feed().after(0))[1]]
        assert states[0] == CREATING
        assert states[-1] in ("DESTROYED", STOPPED)
        assert FAILED not in states  # cancelled, not failed


async def test_restart_keeps_a_matching_vm_and_fails_a_gone_one() -> None:
    from instance_harness import short_dir

    base = short_dir()
    try:
        async with running_node(base=base, cleanup=False) as node:
            await start(node, "inst-1")
            await start(node, "inst-2", workspace_id="ws-2")
        async with running_node(base=base, cleanup=False) as node:
            assert node.manager.get("inst-1").state == RUNNING
            pid, _ = node.manager.get("inst-2").main_process
            os.kill(pid, signal.SIGKILL)
            assert (await node.wait_state("inst-2", FAILED))["reason"] == EXITED_REASON
        async with running_node(base=base) as node:
            assert node.manager.get("inst-1").state == RUNNING
            assert node.manager.get("inst-2").state == FAILED
            held = node.manager.holdings()
            assert (held.instance_count, held.volume_count) == (2, 2)
            assert await node.command("instance.destroy", {"instance_id": "inst-1"}) == \
                {"destroyed": True}
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


async def test_destroy_all_after_isolate() -> None:
    async with running_node() as node:
        await start(node, "inst-1")
        await start(node, "inst-2", workspace_id="ws-2")
        pids = [node.manager.get(i).main_process for i in ("inst-1", "inst-2")]
        assert await node.manager.destroy_all() == 2
        assert all(not alive(*p) for p in pids)
        assert node.manager.holdings().instance_count == 0
        assert list((node.root / "runtime" / "instances").iterdir()) == []


async def test_layer_delete() -> None:
    async with running_node() as node:
        await start(node)
        with pytest.raises(FailedPrecondition, match="in use by Instance inst-1"):
            await node.command("layer.delete", {"pool_id": "pool-a", "ref": "ws-1",
                                                "epoch": 1})
        await node.command("instance.destroy", {"instance_id": "inst-1"})
        assert node.manager.holdings().volume_count == 1
        assert await node.command("layer.delete", {"pool_id": "pool-a", "ref": "ws-1",
                                                   "epoch": 1}) == {"deleted": True}
        objects = node.pool / "retained-layers"
        for sub, suffix in (("data", "ext4"), ("metadata", "json"), ("holders", "json"),
                            ("releases", "json")):
            assert not (objects / sub / f"ws-1.{suffix}").exists()
        assert node.manager.holdings().volume_count == 0
        assert await node.command("layer.delete", {"pool_id": "pool-a", "ref": "ws-1",
                                                   "epoch": 1}) == {"deleted": True}
        with pytest.raises(InvalidArgument):
            await node.command("layer.delete", {"pool_id": "pool-a", "ref": "../x",
                                                "epoch": 1})


async def test_instance_record_is_json_with_the_spec() -> None:
    async with running_node() as node:
        await start(node)
        rec = json.loads((node.manager.get("inst-1").dir / "instance.json").read_text())
        assert rec["spec"]["layer"] == {"pool_id": "pool-a", "ref": "ws-1",
                                        "capacity_bytes": 64 << 20, "epoch": 1,
                                        "create": True}
        assert rec["held"] == [{"kind": "retained-layers", "pool_id": "pool-a",
                                "object_id": "ws-1", "epoch": 1, "released_cleanly": None}]


async def serve_blobs(blobs: dict[str, bytes], seen: list[str], *,
                      task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A stand-in for ctrl's ``GET /v1/artifacts/sha256/<hex>`` (plain HTTP/1.1)."""

    async def handle(stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(4096)
            if not chunk:
                return
            data += chunk
        head = data.split(b"\r\n\r\n")[0].decode()
        path = head.split()[1]
        seen.append(head)
        body = blobs.get(path.rsplit("/", 1)[-1])
        status = "200 OK" if body is not None else "404 Not Found"
        body = body if body is not None else b'{"error":{"code":"not_found","message":"no"}}'
        await stream.send_all(f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n"
                              f"Content-Type: application/octet-stream\r\n"
                              f"Connection: close\r\n\r\n".encode() + body)
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


async def test_a_blob_not_on_the_node_is_fetched_into_the_cache() -> None:
    import hashlib

    kernel = b"a kernel only ctrl has\n"
    hexdigest = hashlib.sha256(kernel).hexdigest()
    seen: list[str] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_blobs, {hexdigest: kernel}, seen)
        async with running_node(ctrl_url=f"http://127.0.0.1:{port}",
                                credential="kid-n:secret") as node:
            args = node.create_args()
            args["template"]["kernel_digest"] = f"sha256:{hexdigest}"
            await node.command("instance.create", args)
            assert (await node.wait_state("inst-1", RUNNING, FAILED))["state"] == RUNNING
            cached = node.root / "template-cache" / "sha256" / hexdigest
            assert cached.read_bytes() == kernel
            inst = node.manager.get("inst-1")
            assert same_file(inst.dir / "platform" / "vmlinux", cached)  # hard-linked
            cache = node.manager.launcher.templates.cache
            assert hexdigest in cache.pinned()
            await node.command("instance.destroy", {"instance_id": "inst-1"})
            assert hexdigest not in cache.pinned()
        nursery.cancel_scope.cancel()
    assert len(seen) == 1
    assert f"GET /v1/artifacts/sha256/{hexdigest}" in seen[0]
    assert "authorization: bearer kid-n:secret" in seen[0].lower()


@pytest.mark.parametrize(("name", "unit_left"), [
    ("node.instance.after-launch-record", False),
    ("node.instance.after-unit-start", True),
])
async def test_node_killed_during_a_launch(name: str, unit_left: bool) -> None:
    """A node process SIGKILLed at a launch step: the next one finds the records and
    finishes the creation (adoption: `kibotos.node.instances.adoption`): launched again when no
    VMM runs, the running unit taken over (its lost launch facts recorded) when one
    does; a force stop then leaves nothing running."""
    import sys

    from instance_harness import TESTPLUGINS, short_dir

    base = short_dir()
    here = HERE
    script = (
        "import sys, trio\n"
        f"sys.path[:0] = [{str(here)!r}, {str(TESTPLUGINS)!r}]\n"
        "from pathlib import Path\n"
        "from instance_harness import running_node\n"
        "async def main():\n"
        f"    async with running_node(base=Path({str(base)!r}), cleanup=False) as node:\n"
        "        await node.command('instance.create', node.create_args())\n"
        "        await trio.sleep(120)\n"
        "trio.run(main)\n")
    env = {**os.environ, "KIBOTOS_FAILPOINTS": f"{name}=kill"}
    try:
        done = await trio.run_process([sys.executable, "-c", script], env=env, check=False,
                                      capture_stderr=True)
        assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
        sup_dir = base / "root" / "runtime" / "supervisor"
        left = list(sup_dir.glob("kibotos-vmm-*.json")) if unit_left else []
        assert len(left) == (1 if unit_left else 0)
        first_pid = json.loads(left[0].read_text())["main_pid"] if left else None
        async with running_node(base=base) as node:
            await node.wait_state("inst-1", RUNNING)
            units = await node.manager.launcher.supervisor.list("kibotos-vmm-")
            assert [u.active for u in units] == [True]
            if unit_left:  # the same VMM, not a second one
                assert units[0].main_pid == first_pid
            assert await node.command("instance.stop", {"instance_id": "inst-1",
                                                        "force": True}) == \
                {"confirmed_on_disk": False}
            assert await node.manager.launcher.supervisor.list("kibotos-vmm-") == []
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


async def test_an_oom_killed_vmm_fails_with_oom_killed() -> None:
    """``direct`` cannot see an OOM kill; systemd reports ``Result=oom-kill``.  A direct
    supervisor that reports its ended units that way stands in for systemd here."""
    import dataclasses

    async with running_node() as node:
        direct = node.manager.launcher.supervisor

        class OomReporting(type(direct)):
            async def describe(self, name):
                info = await super().describe(name)
                if info is not None and not info.active:
                    info = dataclasses.replace(info, result="oom-kill")
                return info

        node.manager.launcher.supervisor = OomReporting({"state_dir": str(direct.state_dir)})
        await start(node)
        pid, _ = node.manager.get("inst-1").main_process
        os.kill(pid, signal.SIGKILL)
        failed = await node.wait_state("inst-1", FAILED)
        assert failed["reason"] == "oom_killed"
        assert node.manager.holdings().instance_count == 1
