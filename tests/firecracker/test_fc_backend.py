"""The ``firecracker`` backend without a Firecracker: options, launch checks, the
jailer's command line flag by flag, the unit, the jail (hard links, bind mounts,
ownership), and the API plan.  The runs against the stand-in are in test_fc_launch.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import fake_jailer
import pytest
from fc_harness import AGENT_PORT, IN_CI, VMM_GID, VMM_UID, FcEnv, short_dir
from kibotos_firecracker import jail as jailmod
from kibotos_firecracker.api import launch_calls
from kibotos_firecracker.backend import UNIT_PROPERTIES, FirecrackerVmm
from kibotos_firecracker.launch import parse_launch

from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.plugins import load_plugins
from kibotos.testing.conformance import BackendFactory, check_id
from kibotos.testing.vmm_suite import VMM_UNIT_CHECKS, VmmCase, VmmCheck


def test_the_plugin_registers_the_firecracker_backend():
    assert load_plugins().vmm.get("firecracker") is FirecrackerVmm


@pytest.mark.parametrize("check", VMM_UNIT_CHECKS, ids=check_id)
async def test_conformance(check: VmmCheck, fc_env: FcEnv) -> None:
    """The unit checks of the VMM seam's suite; test_fc_launch.py runs its guest checks."""
    await check(VmmCase(BackendFactory(FirecrackerVmm, fc_env.options), fc_env.launch))


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize(("options", "error", "words"), [
    ({"colour": "blue"}, InvalidArgument, "[vmm.firecracker]: unknown option colour ("),
    ({"user": "no-such-account-kibotos"}, FailedPrecondition, "does not exist"),
    ({"user": "root"}, InvalidArgument, "is root"),
    ({"uid": 5}, InvalidArgument, "[vmm.firecracker] gid: must be an integer"),
    ({"uid": 0, "gid": 0}, InvalidArgument, "[vmm.firecracker] uid: must be an integer from 1"),
    ({"uid": 5, "gid": 5, "user": "x"}, InvalidArgument, "either user or uid and gid"),
    ({"uid": 5, "gid": 5, "chroot_base_dir": "srv"}, InvalidArgument, "absolute path"),
    ({"uid": 5, "gid": 5, "guest_cid": 2}, InvalidArgument, "guest_cid: must be"),
    ({"uid": 5, "gid": 5, "balloon": "yes"}, InvalidArgument,
     "[vmm.firecracker] balloon: must be true or false, got 'yes'"),
])
def test_bad_options_are_refused(options: dict[str, Any], error: type, words: str):
    with pytest.raises(error) as info:
        FirecrackerVmm(options)
    assert words in info.value.message


def test_the_vmm_account_is_looked_up_by_name():
    vmm = FirecrackerVmm({"user": "nobody"})
    assert vmm.uid == int(subprocess.check_output(["id", "-u", "nobody"]))
    assert vmm.gid == int(subprocess.check_output(["id", "-g", "nobody"]))


# ----------------------------------------------------------------------------- launch


def test_launch_is_parsed(fc_env: FcEnv):
    spec = parse_launch({**fc_env.launch, "taps": [{"host_dev_name": "tap0",
                                                    "guest_mac": "06:00:AC:10:00:02",
                                                    "mtu": 1500}]})
    assert spec.unit_name == "kibotos-vmm-ins-1.service"
    assert (spec.vcpus, spec.memory_mib) == (2, 512)
    assert spec.taps[0].guest_mac == "06:00:ac:10:00:02"
    assert spec.vmm_log == fc_env.run / "vmm.log"


@pytest.mark.parametrize(("change", "words"), [
    ({"instance_id": "ins_1"}, "jailer's --id"),
    ({"instance_id": "x" * 65}, "jailer's --id"),
    ({"vcpus": 33}, "vcpus must be an integer from 1 to 32"),
    ({"memory": "100.5M"}, "whole number of MiB"),
    ({"volumes": [{"path": "/nonexistent"}]}, "volumes[0].path"),
    ({"volumes": [{"path": "/etc/hostname", "serial": "data"}]}, "serial cannot be set"),
    ({"netns_path": "/nonexistent/netns"}, "netns_path /nonexistent/netns does not exist"),
    ({"taps": [{"host_dev_name": "tap-with-a-long-name"}]}, "taps[0].host_dev_name"),
    ({"taps": [{"host_dev_name": "tap0", "guest_mac": "06:00"}]}, "guest_mac"),
    ({"taps": [{"host_dev_name": "tap0", "mtu": 40}]}, "mtu"),
    ({"taps": [{"host_dev_name": "tap0"}, {"host_dev_name": "tap0"}]}, "used twice"),
])
def test_bad_launches_are_refused(fc_env: FcEnv, change: dict[str, Any], words: str):
    with pytest.raises(InvalidArgument) as info:
        parse_launch({**fc_env.launch, **change})
    assert words in info.value.message


# ----------------------------------------------------------------------------- jailer


def test_the_jailer_command_line_flag_by_flag(fc_env: FcEnv):
    netns = fc_env.root / "netns-a"
    netns.write_text("")
    unit = fc_env.backend().unit_for({**fc_env.launch, "netns_path": str(netns)})
    argv = list(unit.argv)
    assert argv[0] == str(fc_env.jailer)
    jailer_args = argv[1:argv.index("--")]
    pairs = dict(zip(jailer_args[::2], jailer_args[1::2], strict=True))
    assert pairs == {
        "--id": "ins-1",  # the Instance ID: the jailer's rule, letters, digits, '-'
        "--exec-file": str(fc_env.firecracker),  # copied into the jail by the jailer
        "--uid": str(VMM_UID),  # the VMM account the jailer drops to
        "--gid": str(VMM_GID),
        "--chroot-base-dir": str(fc_env.base),  # the shared sandbox root
        # v2 without --cgroup: no cgroup is created; the move goes to the unit's own
        "--cgroup-version": "2",
        "--parent-cgroup": "kibotos.slice/kibotos-vmm.slice/kibotos-vmm-ins-1.service",
        "--netns": str(netns),
    }
    # nothing that forks away from the unit's main process, no cgroup settings
    for flag in ("--daemonize", "--new-pid-ns", "--cgroup", "--resource-limit"):
        assert flag not in jailer_args
    assert argv[argv.index("--") + 1:] == ["--api-sock", "/run/firecracker.socket"]
    # and the jailer's documented rules accept it
    args, extra = fake_jailer.parse(argv[1:])
    facts = fake_jailer.check(args)
    assert extra == ["--api-sock", "/run/firecracker.socket"]
    assert facts["chroot"] == str(fc_env.base / "firecracker" / "ins-1" / "root")
    assert facts["cgroup_action"] == "none"  # no such cgroup outside systemd


def test_without_a_netns_there_is_no_netns_flag(fc_env: FcEnv):
    argv = fc_env.backend().unit_for(fc_env.launch).argv
    assert "--netns" not in argv


def test_slice_cgroup_paths():
    assert jailmod.slice_cgroup("kibotos-vmm.slice") == "kibotos.slice/kibotos-vmm.slice"
    assert jailmod.slice_cgroup("a.slice") == "a.slice"
    assert jailmod.slice_cgroup("a-b-c.slice") == "a.slice/a-b.slice/a-b-c.slice"


def test_missing_binaries_refuse_the_unit(fc_env: FcEnv):
    with pytest.raises(FailedPrecondition, match="not found on PATH"):
        fc_env.backend(jailer_binary="no-such-jailer-kibotos").unit_for(fc_env.launch)


# ----------------------------------------------------------------------------- unit


def test_the_unit_properties(fc_env: FcEnv):
    unit = fc_env.backend().unit_for(fc_env.launch)
    assert unit.name == "kibotos-vmm-ins-1.service"
    assert dict(unit.properties) == {
        "Type": "exec", "Restart": "no", "KillMode": "control-group", "OOMPolicy": "kill",
        "Slice": "kibotos-vmm.slice", "PrivateMounts": False,
        "Description": "kibotos VMM (firecracker) for ins-1"}
    assert "LimitMEMLOCK" not in UNIT_PROPERTIES  # Firecracker does not use io_uring
    assert "User" not in unit.properties  # root: the jailer drops privileges itself
    assert unit.environment == {}
    assert unit.working_directory == fc_env.run
    assert unit.log_path == fc_env.run / "vmm.log"


def test_a_netns_is_also_the_units(fc_env: FcEnv):
    netns = fc_env.root / "netns-a"
    netns.write_text("")
    unit = fc_env.backend().unit_for({**fc_env.launch, "netns_path": str(netns)})
    assert unit.properties["NetworkNamespacePath"] == str(netns)


def test_the_systemd_supervisor_takes_every_unit_property(fc_env: FcEnv):
    properties = pytest.importorskip("kibotos_systemd.properties")
    netns = fc_env.root / "netns-a"
    netns.write_text("")
    unit = fc_env.backend().unit_for({**fc_env.launch, "netns_path": str(netns)})
    converted = {k: properties.convert(unit.name, k, v) for k, v in unit.properties.items()}
    assert converted["PrivateMounts"] == ("b", False)
    assert converted["NetworkNamespacePath"] == ("s", str(netns))


# ----------------------------------------------------------------------------- jail


def test_files_are_hard_linked_on_the_same_file_system(fc_env: FcEnv):
    vmm = fc_env.backend()
    vmm.unit_for(fc_env.launch)
    root = fc_env.base / "firecracker" / "ins-1" / "root"
    spec = parse_launch(fc_env.launch)
    for name, source in (("vmlinux", spec.vmlinux), ("initramfs", spec.initramfs),
                         ("rootfs.img", fc_env.template), ("rw.img", fc_env.rw),
                         ("vol0.img", fc_env.vol)):
        assert (root / name).stat().st_ino == source.stat().st_ino, name
    # Instance-owned files go to the VMM account; shared ones keep their owner
    for f in (fc_env.rw, fc_env.vol):
        assert (f.stat().st_uid, f.stat().st_gid) == (VMM_UID, VMM_GID)
        assert f.stat().st_mode & 0o600 == 0o600
    assert fc_env.template.stat().st_uid == 0
    assert jailmod.mounts_under(fc_env.base) == []


def test_a_read_only_volume_is_only_made_readable(fc_env: FcEnv):
    fc_env.vol.chmod(0o400)
    fc_env.backend().unit_for({**fc_env.launch, "volumes": [{"path": str(fc_env.vol),
                                                            "read_only": True}]})
    assert fc_env.vol.stat().st_mode & 0o777 == 0o400
    assert fc_env.vol.stat().st_uid == VMM_UID


def test_a_shared_file_the_vmm_cannot_read_is_refused(fc_env: FcEnv):
    fc_env.template.chmod(0o600)
    with pytest.raises(FailedPrecondition) as info:
        fc_env.backend().unit_for(fc_env.launch)
    assert f"{fc_env.template} is not readable by the VMM account" in info.value.message
    assert not (fc_env.base / "firecracker" / "ins-1").exists()


def test_a_leftover_jail_is_replaced_but_not_a_live_one(fc_env: FcEnv):
    vmm = fc_env.backend()
    vmm.unit_for(fc_env.launch)
    jail = vmm.jail_for(parse_launch(fc_env.launch))
    (jail.root / "stale").write_text("from an earlier start")
    vmm.unit_for(fc_env.launch)
    assert not (jail.root / "stale").exists()
    # a Firecracker still answering on the API socket: the jail is not touched
    jail.api_socket.parent.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(jail.api_socket))
        live.listen(1)
        with pytest.raises(FailedPrecondition, match="still answers"):
            vmm.unit_for(fc_env.launch)
    assert (jail.root / "rw.img").exists()


async def test_release_removes_the_jail_and_keeps_the_pool_files(fc_env: FcEnv):
    vmm = fc_env.backend()
    vmm.unit_for(fc_env.launch)
    await vmm.release(fc_env.launch)
    assert not (fc_env.base / "firecracker" / "ins-1").exists()
    assert fc_env.rw.exists()
    assert fc_env.rw.stat().st_nlink == 1
    await vmm.release(fc_env.launch)  # nothing left: a no-op


def test_socket_paths_that_do_not_fit_are_refused(fc_env: FcEnv):
    deep = fc_env.base / ("d" * 90)
    deep.mkdir(mode=0o700)
    with pytest.raises(FailedPrecondition, match="longer than 107 bytes"):
        fc_env.backend(chroot_base_dir=str(deep)).unit_for(fc_env.launch)


def _mount_tmpfs(path: Path) -> None:
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        msg = f"cannot mount a tmpfs here: {done.stderr.strip()}"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.mark.root
def test_files_are_bind_mounted_from_another_file_system(fc_env: FcEnv):
    """The spec's sandbox root is a tmpfs: nothing can be hard-linked into it."""
    with short_dir() as other:
        sandbox = other / "sandbox"
        sandbox.mkdir(mode=0o700)
        _mount_tmpfs(sandbox)
        try:
            vmm = fc_env.backend(chroot_base_dir=str(sandbox))
            vmm.unit_for(fc_env.launch)
            jail = vmm.jail_for(parse_launch(fc_env.launch))
            points = {p.name for p in jailmod.mounts_under(jail.instance_dir)}
            assert points == {"vmlinux", "initramfs", "rootfs.img", "rw.img", "vol0.img"}
            # the same inode, so the guest serial is the one computed from the pool file
            assert (jail.root / "rw.img").stat().st_ino == fc_env.rw.stat().st_ino
            assert jailmod.guest_serial(jail.root / "rw.img") == \
                jailmod.guest_serial(fc_env.rw)
            # read-only files are read-only binds; the writable layer writes through
            with pytest.raises(OSError, match="Read-only file system"):
                (jail.root / "rootfs.img").open("r+b")
            with open(jail.root / "rw.img", "ab") as f:
                f.write(b"guest data")
            assert fc_env.rw.read_bytes() == b"guest data"
            jailmod.release(jail)
            assert jailmod.mounts_under(sandbox) == [sandbox]  # only the tmpfs itself
            assert not jail.instance_dir.exists()
            assert fc_env.rw.read_bytes() == b"guest data"
        finally:
            subprocess.run(["umount", "-l", str(sandbox)], check=False)


# ----------------------------------------------------------------------------- API plan


def test_the_api_plan(fc_env: FcEnv):
    launch = {**fc_env.launch, "kernel_args": ["loglevel=4"],
              "taps": [{"host_dev_name": "tap0", "guest_mac": "06:00:ac:10:00:02"}]}
    spec = parse_launch(launch)
    files = jailmod.jail_files(spec)
    serials = jailmod.guest_serials(files)
    calls = launch_calls(spec, files, serials, vsock_port=AGENT_PORT, guest_cid=3,
                         balloon=True)
    assert [c.describe() for c in calls] == [
        "PUT /machine-config", "PUT /boot-source", "PUT /drives/root", "PUT /drives/rw",
        "PUT /drives/vol0", "PUT /vsock", "PUT /balloon", "PUT /network-interfaces/eth0",
        "PUT /actions"]
    by = {c.path: c.body for c in calls}
    assert by["/machine-config"] == {"vcpu_count": 2, "mem_size_mib": 512, "smt": False,
                                     "track_dirty_pages": False}
    args = by["/boot-source"]["boot_args"].split()
    assert args[:5] == ["console=ttyS0", "reboot=k", "panic=-1", "pci=off", "quiet"]
    assert f"kibotos.root={jailmod.guest_serial(fc_env.template)}" in args
    assert f"kibotos.rw={jailmod.guest_serial(fc_env.rw)}" in args
    assert "kibotos.disks=3" in args
    assert f"kibotos.vsock={AGENT_PORT}" in args
    assert args[-1] == "loglevel=4"
    assert by["/drives/root"] == {"drive_id": "root", "path_on_host": "/rootfs.img",
                                  "is_root_device": False, "is_read_only": True,
                                  "cache_type": "Unsafe", "io_engine": "Sync"}
    assert by["/drives/rw"]["cache_type"] == "Unsafe"  # spec: no host fsync per guest fsync
    assert by["/drives/rw"]["is_read_only"] is False
    assert by["/vsock"] == {"guest_cid": 3, "uds_path": "/run/agent.vsock"}
    assert by["/network-interfaces/eth0"] == {"iface_id": "eth0", "host_dev_name": "tap0",
                                              "guest_mac": "06:00:ac:10:00:02"}
    assert by["/actions"] == {"action_type": "InstanceStart"}
    no_balloon = launch_calls(spec, files, serials, vsock_port=1, guest_cid=3, balloon=False)
    assert "PUT /balloon" not in [c.describe() for c in no_balloon]


def test_guest_serials_are_device_and_inode(fc_env: FcEnv):
    st = os.stat(fc_env.vol)
    expected = f"{st.st_dev}{st.st_rdev}{st.st_ino}"[:20]
    assert fc_env.backend().volume_devices(fc_env.launch) == [
        f"/dev/disk/by-id/virtio-{expected}"]


def test_the_same_file_twice_is_refused(fc_env: FcEnv):
    spec = parse_launch({**fc_env.launch, "volumes": [{"path": str(fc_env.rw)}]})
    with pytest.raises(FailedPrecondition, match="would both have the guest serial"):
        jailmod.guest_serials(jailmod.jail_files(spec))


def test_mountinfo_escapes_are_read(tmp_path: Path):
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "mountinfo").write_text(
        "36 35 98:0 /x /srv/my\\040jail/a rw - ext4 /dev/root rw\n"
        "37 35 98:0 /y /srv/my\\040jail/a/b/c rw - ext4 /dev/root rw\n"
        "38 35 98:0 /z /srv/other rw - ext4 /dev/root rw\n")
    assert jailmod.mounts_under(Path("/srv/my jail"), tmp_path) == [
        Path("/srv/my jail/a/b/c"), Path("/srv/my jail/a")]


# ----------------------------------------------------------------------------- probe


async def test_probe_reports_versions_kvm_and_the_sandbox_root(fc_env: FcEnv):
    fc_env.base.rmdir()
    vmm = fc_env.backend(kvm_device="/dev/null")  # any read-write device stands in
    probed = await vmm.probe()
    assert probed["backend"] == "firecracker"
    assert probed["firecracker"]["version"] == "Firecracker v1.17.0-dev (stand-in)"
    assert probed["jailer"]["version"] == "Jailer v1.17.0-dev (stand-in)"
    assert probed["kvm"]["usable"] is True
    assert probed["sandbox_root"]["mode"] == "0700"  # created by the probe
    assert probed["sandbox_root"]["tmpfs"] is False
    assert probed["vmm_account"] == {"uid": VMM_UID, "gid": VMM_GID}


@pytest.mark.parametrize(("over", "words"), [
    ({"kvm_device": "/nonexistent/kvm"}, "KVM is not usable"),
    ({"firecracker_binary": "/nonexistent/firecracker"}, "does not run"),
])
async def test_probe_refuses_a_host_that_cannot_run_guests(fc_env: FcEnv,
                                                           over: dict[str, Any], words: str):
    with pytest.raises(FailedPrecondition, match=words):
        await fc_env.backend(**over).probe()


async def test_probe_refuses_a_sandbox_root_others_can_enter(fc_env: FcEnv):
    fc_env.base.chmod(0o755)
    with pytest.raises(FailedPrecondition, match="must be 0700"):
        await fc_env.backend(kvm_device="/dev/null").probe()


# ----------------------------------------------------------------------------- network


def test_the_nodes_network_becomes_the_jails_namespace_and_one_tap(fc_env: FcEnv):
    """``launch["network"]`` (what the node gives every backend) is the jailer's
    namespace and one tap by name with the guest's MAC; the API plan's interface call
    is valid for Firecracker's published API, and the init is told to load virtio-net."""
    from fc_spec import ApiDocument

    network = {"netns_path": "/proc/self/ns/net", "tap": "tap0", "mac": "02:6b:69:00:00:01"}
    spec = parse_launch({**fc_env.launch, "network": network})
    assert spec.netns_path == Path("/proc/self/ns/net")
    assert [(t.host_dev_name, t.guest_mac) for t in spec.taps] == [("tap0",
                                                                    "02:6b:69:00:00:01")]
    files = jailmod.jail_files(spec)
    calls = launch_calls(spec, files, jailmod.guest_serials(files), vsock_port=AGENT_PORT,
                         guest_cid=3, balloon=True)
    by = {c.path: c for c in calls}
    put = by["/network-interfaces/eth0"]
    assert put.body == {"iface_id": "eth0", "host_dev_name": "tap0",
                        "guest_mac": "02:6b:69:00:00:01"}
    document = ApiDocument()
    op, params = document.find(put.method, put.path)
    assert params == {"iface_id": "eth0"}
    assert document.validate(op, json.dumps(put.body).encode()) == put.body
    assert "kibotos.net=1" in by["/boot-source"].body["boot_args"].split()
    assert FirecrackerVmm({"uid": VMM_UID, "gid": VMM_GID}).tap_owner() == (VMM_UID, VMM_GID)


def test_the_nodes_network_does_not_mix_with_netns_path_and_taps(fc_env: FcEnv):
    network = {"netns_path": "/proc/self/ns/net", "tap": "tap0", "mac": "02:6b:69:00:00:01"}
    with pytest.raises(InvalidArgument, match="instead of netns_path and taps"):
        parse_launch({**fc_env.launch, "network": network,
                      "taps": [{"host_dev_name": "tap1"}]})
    with pytest.raises(InvalidArgument, match=r"network\.mac"):
        parse_launch({**fc_env.launch, "network": {**network, "mac": "03:00:00:00:00:01"}})
