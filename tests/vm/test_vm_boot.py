"""Real microVMs under QEMU TCG, booted from the command line `QemuVmm` builds.

Each test boots the cached Platform and ``kibotos-base`` Template, talks to the real
guest agent through `kibotos.guest`, and checks what the guest wrote by reading the
block images with debugfs after QEMU has exited, without mounting anything.  The guest
checks of the VMM seam's conformance suite (`kibotos.testing.vmm_suite`) boot here too,
their units run by the ``direct`` supervisor as on a node.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio
from kibotos_direct.supervisor import DirectSupervisor
from kibotos_qemu.backend import QemuVmm
from vm_harness import POWEROFF, ROOT_TCG, launch_for, running_unit, wait_exit

from kibotos.core.errors import FailedPrecondition
from kibotos.guest import LaunchConfig, Volume, open_guest_channel
from kibotos.platform.images import create_ext4, create_writable_layer, read_file
from kibotos.testing.conformance import BackendFactory, check_id
from kibotos.testing.vmm_suite import VMM_GUEST_CHECKS, VmmCase, VmmCheck

pytestmark = [pytest.mark.slow, pytest.mark.qemu]

BOOT_TIMEOUT = 180  # TCG on a busy 2-core machine; a normal boot takes 5-10 s


def _process_facts(pid: int) -> tuple[str, str]:
    return os.readlink(f"/proc/{pid}/exe"), Path(f"/proc/{pid}/status").read_text()


def _realpath(path: str) -> str:
    return os.path.realpath(path)


async def _backend() -> QemuVmm:
    vmm = QemuVmm(ROOT_TCG)
    facts = await vmm.probe()
    assert facts["accelerator"] == "tcg"
    return vmm


@pytest.mark.parametrize("check", VMM_GUEST_CHECKS, ids=check_id)
async def test_conformance(check: VmmCheck, platform_dir: Path, template_dir: Path,
                           run_dir: Path) -> None:
    create_writable_layer(run_dir / "rw.img", 1 << 30)
    supervisor = DirectSupervisor({"state_dir": str(run_dir / "units")})
    await check(VmmCase(BackendFactory(QemuVmm, ROOT_TCG),
                        launch_for(run_dir, platform_dir, template_dir),
                        supervisor=supervisor, ready_timeout=BOOT_TIMEOUT))


async def test_boot_exec_volume_poweroff_and_read_back(platform_dir: Path,
                                                       template_dir: Path, run_dir: Path):
    create_writable_layer(run_dir / "rw.img", 1 << 30)
    create_writable_layer(run_dir / "vol.img", 256 << 20)
    launch = launch_for(run_dir, platform_dir, template_dir,
                        volumes=[{"path": str(run_dir / "vol.img"), "serial": "vol-data"}])
    vmm = await _backend()
    unit = vmm.unit_for(launch)
    async with running_unit(unit) as proc:
        hello = await vmm.wait_ready(launch, timeout=BOOT_TIMEOUT)
        assert hello["protocol_version"] == 1
        assert len(hello["boot_id"]) == 36
        assert "exec" in hello["capabilities"]

        # The wrapper exec'd QEMU: the unit's main process is QEMU, with THP disabled.
        exe, status = _process_facts(proc.pid)
        assert exe == _realpath(vmm.qemu_binary)
        assert "THP_enabled:\t0" in status

        stream = await vmm.guest_channel(launch)
        async with open_guest_channel(stream) as guest:
            await guest.wait_hello(trio.current_time() + 30)
            await guest.configure(LaunchConfig(
                volumes=[Volume(vmm.volume_devices(launch)[0], "/data")],
                retained_filesystems=list(QemuVmm.GUEST_RETAINED_FILESYSTEMS)))
            status_, out, err = await guest.run(["sh", "-c", (
                "uname -r; "
                "echo from-the-layer > /root/layer.txt; "
                "echo from-the-volume > /data/volume.txt; "
                "findmnt -n -o FSTYPE /; findmnt -n -o OPTIONS /run/kibotos/template; "
                "cat /proc/1/comm")])
            assert status_.returncode == 0, err
            lines = out.decode().split()
            release = json.loads((platform_dir / "platform.json").read_text())["kernel"]
            assert lines[0] == release["release"]
            assert lines[1] == "overlay"
            assert lines[2].startswith("ro")
            assert lines[3] == "init"  # tini, the reaping init, is PID 1; the agent is not
            await guest.exec(POWEROFF)
            assert await wait_exit(proc, BOOT_TIMEOUT) == 0

    # The guest's root is an overlay whose upper directory is on the writable layer.
    assert read_file(run_dir / "rw.img", "/upper/root/layer.txt") == b"from-the-layer\n"
    assert read_file(run_dir / "vol.img", "/volume.txt") == b"from-the-volume\n"
    # The Template image was attached read-only and is unchanged.
    with pytest.raises(FileNotFoundError):
        read_file(template_dir / "image", "/root/layer.txt")
    console = (run_dir / "console.log").read_text(errors="replace")
    assert "kibotos-init: starting agent" in console


async def test_stop_after_prepare_keeps_the_layer_for_the_next_boot(
        platform_dir: Path, template_dir: Path, run_dir: Path):
    """The node's normal stop (stop_prepare, then the VMM is stopped) and a new start
    on the same writable layer: what the first boot wrote is there."""
    create_writable_layer(run_dir / "rw.img", 1 << 30)
    launch = launch_for(run_dir, platform_dir, template_dir)
    vmm = await _backend()
    async with running_unit(vmm.unit_for(launch)) as proc:
        first = await vmm.wait_ready(launch, timeout=BOOT_TIMEOUT)
        async with open_guest_channel(await vmm.guest_channel(launch)) as guest:
            await guest.configure(LaunchConfig(retained_filesystems=["/run/kibotos/rw"]))
            status, _, err = await guest.run(["sh", "-c", "echo kept > /var/kept.txt"])
            assert status.returncode == 0, err
            result = await guest.stop_prepare(trio.current_time() + 60)
            assert "/run/kibotos/rw" in result.frozen
        proc.terminate()
        await wait_exit(proc, 60)
    assert read_file(run_dir / "rw.img", "/upper/var/kept.txt") == b"kept\n"

    async with running_unit(vmm.unit_for(launch)):
        second = await vmm.wait_ready(launch, timeout=BOOT_TIMEOUT)
        assert second["boot_id"] != first["boot_id"]
        async with open_guest_channel(await vmm.guest_channel(launch)) as guest:
            status, out, _ = await guest.run(["cat", "/var/kept.txt"])
            assert (status.returncode, out) == (0, b"kept\n")


async def test_a_guest_that_cannot_mount_its_layer_fails_fast(
        platform_dir: Path, template_dir: Path, run_dir: Path):
    """A writable layer that is not ext4: the init says why on the console and powers
    off; wait_ready reports that line long before its deadline."""
    (run_dir / "rw.img").write_bytes(b"\0" * (1 << 20))
    launch = launch_for(run_dir, platform_dir, template_dir)
    vmm = await _backend()
    async with running_unit(vmm.unit_for(launch)) as proc:
        # A timeout would raise DeadlineExceeded, not this.
        with pytest.raises(FailedPrecondition, match="kibotos-init: FAILED: mount writable"):
            await vmm.wait_ready(launch, timeout=BOOT_TIMEOUT)
        assert await wait_exit(proc, BOOT_TIMEOUT) == 0  # the init powered the guest off


async def test_volume_image_made_from_a_directory_is_readable_in_the_guest(
        platform_dir: Path, template_dir: Path, run_dir: Path, tmp_path: Path):
    """A read-only Volume filled on the host (mkfs.ext4 -d) shows its files in the guest."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "hello.txt").write_text("made on the host\n")
    create_ext4(run_dir / "ro.img", 64 << 20, source_dir=src)
    create_writable_layer(run_dir / "rw.img", 1 << 30)
    launch = launch_for(run_dir, platform_dir, template_dir,
                        volumes=[{"path": str(run_dir / "ro.img"), "read_only": True}])
    vmm = await _backend()
    async with running_unit(vmm.unit_for(launch)):
        await vmm.wait_ready(launch, timeout=BOOT_TIMEOUT)
        async with open_guest_channel(await vmm.guest_channel(launch)) as guest:
            await guest.configure(LaunchConfig(volumes=[
                Volume("/dev/disk/by-id/virtio-kibotos-vol0", "/ro", read_only=True,
                       retained=False)]))
            status, out, _ = await guest.run(["cat", "/ro/hello.txt"])
            assert (status.returncode, out) == (0, b"made on the host\n")
            status, _, err = await guest.run(["sh", "-c", "echo x > /ro/new"])
            assert status.returncode != 0
            assert b"Read-only file system" in err


async def test_the_platform_answers_the_probe_and_kvm_is_judged_by_a_real_boot(
        platform_dir: Path, tmp_path: Path):
    """The probe guest is the Platform itself with ``kibotos.probe``: under TCG it prints
    the marker and powers off; under KVM the answer is whatever a real boot shows here
    (TESTBED: on these machines KVM opens but guests do not run), and it is cached."""
    from kibotos_qemu import probe

    vmm = QemuVmm({"platform_dir": str(platform_dir), "cache_dir": str(tmp_path),
                   "probe_timeout": 30, "user": "root"})
    tcg = probe.probe_argv("qemu-system-x86_64", platform_dir / "vmlinux",
                           platform_dir / "initramfs", accel="tcg", host_mhz=vmm.host_mhz())
    booted, reason, _ = await probe.boot_probe(tcg, BOOT_TIMEOUT)
    assert (booted, reason) == (True, "probe guest booted")

    facts = await vmm.probe()
    kvm = facts["kvm"]
    assert facts["accelerator"] == ("kvm" if kvm["usable"] else "tcg")
    assert kvm["reason"]
    assert kvm["cached"] is False
    again = await QemuVmm({"platform_dir": str(platform_dir), "cache_dir": str(tmp_path),
                           "probe_timeout": 30, "user": "root"}).probe()
    if not kvm["reason"].startswith("/dev/kvm"):  # a device that opens: the boot is cached
        assert again["kvm"]["cached"] is True
    assert again["accelerator"] == facts["accelerator"]


def _read_console(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


async def _console_shows(path: Path, text: str, timeout: float) -> str:
    with trio.fail_after(timeout):
        while True:
            console = await trio.to_thread.run_sync(_read_console, path)
            if text in console:
                return console
            await trio.sleep(0.2)


async def test_kibotos_vsock_loads_the_vsock_modules_and_serves_the_agent_on_that_port(
        platform_dir: Path, template_dir: Path, run_dir: Path):
    """What a Firecracker guest gets (``kibotos.vsock=PORT``), booted under QEMU: the
    init loads the vsock modules of the real kernel and starts the agent on AF_VSOCK
    instead of the virtio-serial ports (QEMU here has no vsock device, so nobody
    connects; the agent says where it listens)."""
    create_writable_layer(run_dir / "rw.img", 1 << 30)
    launch = launch_for(run_dir, platform_dir, template_dir,
                        kernel_args=["kibotos.vsock=1024"])
    vmm = await _backend()
    async with running_unit(vmm.unit_for(launch)):
        console = await _console_shows(run_dir / "console.log",
                                       "listening on vsock port 1024", BOOT_TIMEOUT)
    assert "kibotos-init: modules loaded" in console
    assert "FAILED" not in console


async def test_a_bad_kibotos_vsock_port_fails_the_boot_with_the_reason(
        platform_dir: Path, template_dir: Path, run_dir: Path):
    create_writable_layer(run_dir / "rw.img", 1 << 30)
    launch = launch_for(run_dir, platform_dir, template_dir,
                        kernel_args=["kibotos.vsock=12ab"])
    vmm = await _backend()
    async with running_unit(vmm.unit_for(launch)) as proc:
        with pytest.raises(FailedPrecondition,
                           match=r"kibotos\.vsock=12ab is not a port number"):
            await vmm.wait_ready(launch, timeout=BOOT_TIMEOUT)
        assert await wait_exit(proc, BOOT_TIMEOUT) == 0
