"""The ``qemu`` backend without booting Linux: the unit checks of the VMM seam's
conformance suite (`kibotos.testing.vmm_suite`; its guest checks boot in
test_vm_boot.py), then launch checks, the command line, the unit, the no-THP wrapper,
the KVM probe against stand-in QEMUs, and readiness against the real guest agent run
on the host."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from kibotos_qemu import cmdline, probe
from kibotos_qemu.backend import ROOT_WARNING, UNIT_PROPERTIES, QemuVmm
from kibotos_qemu.launch import parse_launch
from kibotos_qemu.ready import wait_hello
from vm_harness import ROOT_TCG

from kibotos.core.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from kibotos.guest import AGENT_PATH
from kibotos.plugins import load_plugins
from kibotos.testing.conformance import BackendFactory, check_id
from kibotos.testing.vmm_suite import VMM_UNIT_CHECKS, VmmCase, VmmCheck


@pytest.fixture
def launch(tmp_path: Path) -> dict:
    plat = tmp_path / "platform"
    plat.mkdir()
    (plat / "vmlinux").write_bytes(b"k")
    (plat / "initramfs").write_bytes(b"i")
    run = tmp_path / "run,1"  # a comma, which QEMU option values must double
    run.mkdir()
    for name in ("template.img", "rw.img", "vol.img"):
        (tmp_path / name).write_bytes(b"")
    return {
        "instance_id": "ins-1",
        "runtime_dir": str(run),
        "platform_dir": str(plat),
        "template_image": str(tmp_path / "template.img"),
        "writable_layer": str(tmp_path / "rw.img"),
        "volumes": [{"path": str(tmp_path / "vol.img"), "serial": "vol-a"},
                    {"path": str(tmp_path / "vol.img"), "read_only": True}],
        "vcpus": 2,
        "memory": "512M",
    }


def test_the_plugin_registers_the_qemu_backend():
    regs = load_plugins()
    assert regs.vmm.get("qemu") is QemuVmm


@pytest.mark.parametrize("check", VMM_UNIT_CHECKS, ids=check_id)
async def test_conformance(check: VmmCheck, launch: dict) -> None:
    await check(VmmCase(BackendFactory(QemuVmm, ROOT_TCG), launch))


# ----------------------------------------------------------------------------- launch


def test_launch_is_parsed(launch: dict):
    spec = parse_launch(launch)
    assert spec.unit_name == "kibotos-vmm-ins-1.service"
    assert spec.memory_bytes == 512 << 20
    assert spec.vcpus == 2
    assert [(v.serial, v.read_only) for v in spec.volumes] == [("vol-a", False),
                                                               ("kibotos-vol1", True)]
    assert spec.agent_socket.name == "agent.sock"


@pytest.mark.parametrize(("change", "message"), [
    ({"instance_id": "../x"}, "instance_id"),
    ({"writable_layer": None}, "writable_layer is required"),
    ({"vcpus": 0}, "vcpus must be an integer from 1 to 64"),
    ({"vcpus": "2"}, "vcpus must be an integer"),
    ({"volumes": [{"path": "/nonexistent"}]}, r"volumes\[0\].path"),
    ({"volumes": "x"}, "volumes must be a list"),
    ({"kernel_args": ["a b"]}, "kernel_args"),
    ({"netns_path": "/run/netns/x"}, "unknown keys"),
    ({"network": {"netns_path": "run/netns/x", "tap": "tap0",
                  "mac": "02:00:00:00:00:01"}}, "network.netns_path must be an absolute"),
    ({"network": {"netns_path": "/proc/self/ns/net", "tap": "a/b",
                  "mac": "02:00:00:00:00:01"}}, "network.tap"),
    ({"network": {"netns_path": "/proc/self/ns/net", "tap": "tap0",
                  "mac": "01:00:00:00:00:01"}}, "network.mac"),
    ({"network": {"netns_path": "/proc/self/ns/net", "tap": "tap0", "mac": "02:00:00:00:00:01",
                  "fd": 3}}, "network has unknown keys"),
    ({"unit_name": ".hidden"}, "not a valid unit name"),
])
def test_bad_launches_are_refused_naming_the_key(launch: dict, change: dict, message: str):
    with pytest.raises(InvalidArgument, match=message):
        parse_launch({**launch, **change})


def test_a_network_is_a_tap_by_name_in_the_units_namespace(launch: dict):
    """QEMU opens the node's persistent tap by name (no script, no vhost-net) in the
    namespace the unit joins; the guest's virtio-net device has the node's MAC; the
    init is told to load virtio-net.  Without a network: none of it."""
    network = {"netns_path": "/proc/self/ns/net", "tap": "tap0", "mac": "02:6b:69:00:00:01"}
    spec = parse_launch({**launch, "network": network})
    args = cmdline.qemu_args(spec, "tcg", 2596)
    assert _pairs(args, "-netdev") == [
        "tap,id=net0,ifname=tap0,script=no,downscript=no,vhost=off"]
    assert "virtio-net-device,netdev=net0,mac=02:6b:69:00:00:01" in _pairs(args, "-device")
    assert "kibotos.net=1" in cmdline.kernel_cmdline(spec, "tcg", 2596).split()
    vmm = QemuVmm({"accelerator": "tcg", "qemu_binary": "/bin/true", "user": "root"})
    vmm.accelerator = "tcg"
    props = vmm.unit_for({**launch, "network": network}).properties
    assert props["NetworkNamespacePath"] == "/proc/self/ns/net"
    assert QemuVmm.CAN_NETWORK
    plain = cmdline.qemu_args(parse_launch(launch), "tcg", 2596)
    assert "-netdev" not in plain
    assert "kibotos.net=1" not in cmdline.kernel_cmdline(parse_launch(launch), "tcg", 2596)
    assert "NetworkNamespacePath" not in vmm.unit_for(launch).properties
    assert vmm.tap_owner() == (0, 0)  # user = "root": a tap of root's
    assert QemuVmm({"user": "nobody"}).tap_owner()[0] == 65534


def test_volume_serials_must_be_unique_short_and_unreserved(launch: dict):
    vol = launch["volumes"][0]["path"]
    for volumes, message in [
        ([{"path": vol, "serial": "a" * 21}], "1-20 letters"),
        ([{"path": vol, "serial": "kibotos-rw"}], "reserved"),
        ([{"path": vol, "serial": "s"}, {"path": vol, "serial": "s"}], "used twice"),
        ([{"path": vol, "mode": "rw"}], "unknown keys"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            parse_launch({**launch, "volumes": volumes})


def test_platform_dir_must_hold_kernel_and_initramfs(launch: dict):
    (Path(launch["platform_dir"]) / "initramfs").unlink()
    with pytest.raises(InvalidArgument, match="has no initramfs"):
        parse_launch(launch)


# ----------------------------------------------------------------------------- command line


def _pairs(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_tcg_command_line_carries_testbed_flags(launch: dict):
    spec = parse_launch(launch)
    args = cmdline.qemu_args(spec, "tcg", 2596)
    assert _pairs(args, "-M") == ["microvm"]
    assert _pairs(args, "-accel") == ["tcg,tb-size=32"]
    assert _pairs(args, "-cpu") == ["qemu64,+arat"]
    assert _pairs(args, "-m") == ["512M"]
    assert _pairs(args, "-smp") == ["2"]
    assert "-no-reboot" in args
    assert "-nodefaults" in args
    append = _pairs(args, "-append")[0].split()
    for word in ("console=ttyS0", "panic=-1", "tsc_early_khz=2596000", "tsc=reliable",
                 "mitigations=off", "audit=0", "8250.nr_uarts=1", "cryptomgr.notests",
                 "kibotos.port=org.kibotos.agent.0,org.kibotos.agent.1", "kibotos.disks=4"):
        assert word in append
    drives = _pairs(args, "-drive")
    assert all("cache=unsafe,aio=threads" in d for d in drives)
    assert ["read-only=on" in d for d in drives] == [True, False, False, True]
    assert f"file={launch['template_image']}" in drives[0]
    devices = _pairs(args, "-device")
    assert [d for d in devices if d.startswith("virtio-blk-device")] == [
        "virtio-blk-device,drive=template,serial=kibotos-root,discard=off",
        "virtio-blk-device,drive=rw,serial=kibotos-rw,discard=off",
        "virtio-blk-device,drive=vol0,serial=vol-a,discard=off",
        "virtio-blk-device,drive=vol1,serial=kibotos-vol1,discard=off"]
    assert "virtserialport,chardev=agent,name=org.kibotos.agent.0" in devices
    assert "virtserialport,chardev=agentdp,name=org.kibotos.agent.1" in devices
    assert "virtio-balloon-device,free-page-reporting=on" in devices
    run = launch["runtime_dir"].replace(",", ",,")
    assert f"socket,id=agent,path={run}/agent.sock,server=on,wait=off" in _pairs(
        args, "-chardev")
    assert f"socket,id=agentdp,path={run}/agent-dp.sock,server=on,wait=off" in _pairs(
        args, "-chardev")
    assert f"file,id=console,path={run}/console.log" in _pairs(args, "-chardev")


def test_kvm_command_line_uses_the_host_cpu_and_no_tsc_trims(launch: dict):
    args = cmdline.qemu_args(parse_launch({**launch, "kernel_args": ["loglevel=7"]}), "kvm",
                             2596)
    assert _pairs(args, "-accel") == ["kvm"]
    assert _pairs(args, "-cpu") == ["host"]
    append = _pairs(args, "-append")[0]
    assert "tsc" not in append
    assert "mitigations" not in append
    assert append.endswith("loglevel=7")


def test_host_cpu_mhz():
    assert cmdline.host_cpu_mhz("processor\t: 0\ncpu MHz\t\t: 2596.148\n") == 2596
    assert cmdline.host_cpu_mhz("processor: 0\n") is None


def test_the_wrapper_disables_thp_and_execs(tmp_path: Path):
    grep = "/usr/bin/grep" if Path("/usr/bin/grep").exists() else "/bin/grep"
    argv = cmdline.wrapped_argv(grep, ["-E", "^(THP_enabled|Name):", "/proc/self/status"])
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert "Name:\tgrep" in out  # exec'd: the process is the program, not python
    assert "THP_enabled:\t0" in out


# ----------------------------------------------------------------------------- unit


async def test_unit_has_the_spec_properties(launch: dict):
    vmm = QemuVmm({"accelerator": "tcg", "proc_root": "/proc", "user": "root"})
    with pytest.raises(FailedPrecondition, match="probe"):
        QemuVmm({}).unit_for(launch)
    facts = await vmm.probe()
    assert facts["accelerator"] == "tcg"
    assert facts["kvm"]["usable"] is False
    unit = vmm.unit_for(launch)
    assert unit.name == "kibotos-vmm-ins-1.service"
    for key, value in {"Type": "exec", "Restart": "no", "KillMode": "control-group",
                       "OOMPolicy": "kill", "Slice": "kibotos-vmm.slice",
                       "LimitMEMLOCK": "infinity", "PrivateMounts": False}.items():
        assert unit.properties[key] == value
    assert set(UNIT_PROPERTIES) <= set(unit.properties)
    assert unit.argv[:4] == [sys.executable, "-I", "-S", "-c"]
    assert unit.argv[5] == vmm.qemu_binary
    assert unit.log_path == Path(launch["runtime_dir"]) / "vmm.log"
    assert unit.working_directory == Path(launch["runtime_dir"])
    # Root only when asked for, and then the node is told to warn at startup.
    assert "User" not in unit.properties
    assert facts["user"] == "root"
    assert facts["warnings"] == [ROOT_WARNING]


async def test_the_vmm_runs_as_the_non_root_account_by_default(launch: dict):
    """spec: the KiboVM service runs directly as the non-root VMM account, with the
    supplementary group kvm; its sockets and logs are not for other local users."""
    props = QemuVmm({"accelerator": "tcg"}).unit_for(launch).properties
    assert props["User"] == "kibotos-vmm"
    assert props["SupplementaryGroups"] == ["kvm"]
    assert props["UMask"] == 0o007
    nobody = QemuVmm({"accelerator": "tcg", "user": "nobody"})
    facts = await nobody.probe()
    assert facts["user"] == "nobody"
    assert facts["warnings"] == []
    assert nobody.unit_for(launch).properties["User"] == "nobody"
    # An account that is not there: the probe fails, so the node refuses creates.
    with pytest.raises(FailedPrecondition, match="VMM account 'no-such-account-kibotos' "
                       "does not exist"):
        await QemuVmm({"accelerator": "tcg", "user": "no-such-account-kibotos"}).probe()


def test_volume_devices_are_named_by_serial(launch: dict):
    vmm = QemuVmm(ROOT_TCG)
    assert vmm.volume_devices(launch) == ["/dev/disk/by-id/virtio-vol-a",
                                          "/dev/disk/by-id/virtio-kibotos-vol1"]
    assert QemuVmm.GUEST_RETAINED_FILESYSTEMS == ("/run/kibotos/rw",)


def test_bad_options_are_refused():
    with pytest.raises(InvalidArgument, match=r"^\[vmm\.qemu\]: unknown option qemu "):
        QemuVmm({"qemu": "x"})
    with pytest.raises(InvalidArgument, match=r"^\[vmm\.qemu\] accelerator: must be one of "
                       r"auto, kvm, tcg, got 'hvf'$"):
        QemuVmm({"accelerator": "hvf"})


async def test_probe_needs_a_runnable_qemu(tmp_path: Path, launch: dict):
    with pytest.raises(FailedPrecondition, match="does not run"):
        await QemuVmm({"qemu_binary": str(tmp_path / "no-qemu"), "user": "root"}).probe()
    with pytest.raises(FailedPrecondition, match="no-such-qemu not found on PATH"):
        QemuVmm({"qemu_binary": "no-such-qemu", "accelerator": "tcg"}).unit_for(launch)


# ----------------------------------------------------------------------------- KVM probe


def _fake_qemu(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "fake-qemu"
    path.write_text("#!/bin/sh\n"
                    'if [ "$1" = "--version" ]; then echo "QEMU emulator version 9.9.9"; '
                    "exit 0; fi\n"
                    f"echo run >> {tmp_path}/runs\n{body}\n")
    path.chmod(0o755)
    return path


def _platform(tmp_path: Path) -> Path:
    plat = tmp_path / "plat"
    plat.mkdir(exist_ok=True)
    (plat / "vmlinux").write_bytes(b"k")
    (plat / "initramfs").write_bytes(b"i")
    return plat


def _runs(tmp_path: Path) -> int:
    f = tmp_path / "runs"
    return len(f.read_text().splitlines()) if f.exists() else 0


async def test_probe_uses_kvm_when_the_probe_guest_boots_and_caches_it(tmp_path: Path):
    qemu = _fake_qemu(tmp_path, "echo 'Linux booting'; echo KIBOTOS-PROBE-OK; sleep 30")
    kvm = tmp_path / "kvm"
    kvm.write_bytes(b"")  # opens read-write: like a /dev/kvm that opens
    plat = _platform(tmp_path)
    result = await probe.probe_kvm(qemu_binary=str(qemu), vmlinux=plat / "vmlinux",
                                   initramfs=plat / "initramfs", cache_dir=tmp_path / "c",
                                   timeout=60, kvm_dev=kvm)
    assert (result["usable"], result["cached"]) == (True, False)
    again = await probe.probe_kvm(qemu_binary=str(qemu), vmlinux=plat / "vmlinux",
                                  initramfs=plat / "initramfs", cache_dir=tmp_path / "c",
                                  timeout=60, kvm_dev=kvm)
    assert (again["usable"], again["cached"]) == (True, True)
    assert _runs(tmp_path) == 1


async def test_a_hanging_probe_guest_means_tcg_and_is_killed(tmp_path: Path):
    qemu = _fake_qemu(tmp_path, f"echo $$ > {tmp_path}/pid; echo 'entering protected mode';"
                                " exec sleep 300")
    kvm = tmp_path / "kvm"
    kvm.write_bytes(b"")
    plat = _platform(tmp_path)
    result = await probe.probe_kvm(qemu_binary=str(qemu), vmlinux=plat / "vmlinux",
                                   initramfs=plat / "initramfs", cache_dir=None,
                                   timeout=1.0, kvm_dev=kvm)
    assert result["usable"] is False
    assert "did not boot within 1 s" in result["reason"]
    pid = int((tmp_path / "pid").read_text())
    assert not _exists(Path(f"/proc/{pid}"))


async def test_a_probe_guest_that_exits_early_says_what_it_printed(tmp_path: Path):
    qemu = _fake_qemu(tmp_path, "echo 'qemu: could not load kernel' >&2; exit 1")
    kvm = tmp_path / "kvm"
    kvm.write_bytes(b"")
    plat = _platform(tmp_path)
    result = await probe.probe_kvm(qemu_binary=str(qemu), vmlinux=plat / "vmlinux",
                                   initramfs=plat / "initramfs", cache_dir=None,
                                   timeout=60, kvm_dev=kvm)
    assert result["usable"] is False
    assert "exited before booting: qemu: could not load kernel" in result["reason"]


async def test_no_kvm_device_or_no_platform_means_no_probe_boot(tmp_path: Path):
    qemu = _fake_qemu(tmp_path, "echo KIBOTOS-PROBE-OK")
    plat = _platform(tmp_path)
    result = await probe.probe_kvm(qemu_binary=str(qemu), vmlinux=plat / "vmlinux",
                                   initramfs=plat / "initramfs", cache_dir=None, timeout=5,
                                   kvm_dev=tmp_path / "no-kvm")
    assert result["usable"] is False
    assert "No such file" in result["reason"]
    kvm = tmp_path / "kvm"
    kvm.write_bytes(b"")
    result = await probe.probe_kvm(qemu_binary=str(qemu), vmlinux=None, initramfs=None,
                                   cache_dir=None, timeout=5, kvm_dev=kvm)
    assert result["usable"] is False
    assert "no Platform" in result["reason"]
    assert _runs(tmp_path) == 0


async def test_accelerator_kvm_refuses_a_host_where_kvm_does_not_boot(tmp_path: Path,
                                                                      monkeypatch):
    qemu = _fake_qemu(tmp_path, "exit 1")

    async def no_kvm(**kwargs):
        return {"usable": False, "reason": "probe guest did not boot within 20 s",
                "seconds": 20.0, "cached": False}

    monkeypatch.setattr(probe, "probe_kvm", no_kvm)
    with pytest.raises(FailedPrecondition, match="KVM is not usable here: probe guest"):
        await QemuVmm({"qemu_binary": str(qemu), "accelerator": "kvm", "user": "root"}).probe()
    facts = await QemuVmm({"qemu_binary": str(qemu), "user": "root"}).probe()
    assert facts["accelerator"] == "tcg"
    assert facts["qemu"]["version"] == "9.9.9"


# ----------------------------------------------------------------------------- readiness


def _exists(path: Path) -> bool:
    return path.exists()


def _append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def _start_agent(sock: Path, root: Path) -> subprocess.Popen[bytes]:
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    return subprocess.Popen([python, str(AGENT_PATH), "--socket", str(sock), "--root",
                             str(root)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def test_ready_returns_the_real_agents_hello(tmp_path: Path):
    sock = tmp_path / "agent.sock"
    root = tmp_path / "root"
    root.mkdir()
    # Started a moment later, so the first connects are refused and retried.
    agent = None
    try:
        async with trio.open_nursery() as nursery:
            async def start_late() -> None:
                nonlocal agent
                await trio.sleep(0.3)
                agent = _start_agent(sock, root)
            nursery.start_soon(start_late)
            info = await wait_hello(sock, tmp_path / "console.log",
                                    trio.current_time() + 60)
        assert info.protocol_version == 1
        assert info.boot_id
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait()


async def test_ready_times_out_with_the_console_tail(tmp_path: Path):
    sock = tmp_path / "agent.sock"
    listener = trio.socket.socket(trio.socket.AF_UNIX)
    await listener.bind(str(sock))
    listener.listen()  # accepts, never says hello
    (tmp_path / "console.log").write_text("booting\nkibotos-init: starting agent at 1.7s\n")
    with pytest.raises(DeadlineExceeded, match=r"starting agent at 1\.7s"):
        await wait_hello(sock, tmp_path / "console.log", trio.current_time() + 1.0)
    listener.close()


async def test_ready_stops_waiting_when_the_console_shows_the_init_failed(tmp_path: Path):
    console = tmp_path / "console.log"
    console.write_text("")

    async def guest_fails() -> None:
        await trio.sleep(0.5)
        _append(console, "kibotos-init: FAILED: mount writable layer\n")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(guest_fails)
        # Nothing ever listens; a timeout would be DeadlineExceeded, not this.
        with pytest.raises(FailedPrecondition, match="FAILED: mount writable layer"):
            await wait_hello(tmp_path / "agent.sock", console, trio.current_time() + 120)


def test_kvm_openable_reports_the_reason(tmp_path: Path):
    assert "No such file" in (probe.kvm_openable(tmp_path / "nope") or "")
    os.close(os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR))
    assert probe.kvm_openable(tmp_path / "f") is None


def test_probe_guest_flags_follow_the_accelerator(tmp_path: Path):
    kvm = probe.probe_argv("q", tmp_path / "k", tmp_path / "i")
    assert _pairs(kvm, "-cpu") == ["host"]
    assert "tsc" not in _pairs(kvm, "-append")[0]
    assert _pairs(kvm, "-append")[0].endswith("kibotos.probe")
    tcg = probe.probe_argv("q", tmp_path / "k", tmp_path / "i", accel="tcg", host_mhz=2000)
    assert _pairs(tcg, "-cpu") == ["qemu64,+arat"]
    assert "tsc_early_khz=2000000 tsc=reliable" in _pairs(tcg, "-append")[0]
