"""The VMM units the two backends build (``unit_for``), started through the ``systemd``
supervisor in a real systemd (a user manager, usersystemd.py): the spec's "VMM service"
properties are what systemd holds for them, and the processes get them.

Only ``argv`` is replaced (by ``sleep``): the QEMU and jailer command lines need a real
Platform and a real jailer, which the backend tests (tests/vm, tests/firecracker) cover;
name, properties, environment, working directory and log file are the backends' own.

Not produced here (TESTBED.md): the effective ``LimitMEMLOCK=infinity`` (the test runs
without CAP_SYS_RESOURCE, so systemd cannot raise the process's hard limit; the unit's
value is asserted), OOM kills (``OOMPolicy=kill`` asserted as a property; this host's
cgroups are v1 hybrid), and ``User=`` with ``SupplementaryGroups=kvm`` when the host
has no ``kvm`` group (the unit is then started as root and the User property is checked
in tests/vm/test_vm_qemu_backend.py).
"""

from __future__ import annotations

import dataclasses
import grp
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from systemd_helpers import Raw

from kibotos.backends import Supervisor, UnitSpec

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.systemd]

INFINITY = 2**64 - 1
DEADLINE = 60
VMM_SETTINGS = {"Type": "exec", "Restart": "no", "KillMode": "control-group",
                "OOMPolicy": "kill", "Slice": "kibotos-vmm.slice", "PrivateMounts": False}
NO_STOP_DEPENDENCY = ("BindsTo", "PartOf", "Requires", "Requisite", "StopPropagatedFrom")


def has_group(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def read_status(pid: int) -> str:
    return Path(f"/proc/{pid}/status").read_text()


def base_launch(root: Path) -> dict:
    plat = root / "platform"
    plat.mkdir()
    for name in ("vmlinux", "initramfs"):
        (plat / name).write_bytes(name.encode() * 64)
        (plat / name).chmod(0o644)
    for name in ("template.img", "rw.img", "vol0.img"):
        (root / name).write_bytes(b"t" * 4096)
        (root / name).chmod(0o644)
    run = root / "run"
    run.mkdir()
    return {"instance_id": "ins-1", "runtime_dir": str(run), "platform_dir": str(plat),
            "template_image": str(root / "template.img"),
            "writable_layer": str(root / "rw.img"),
            "volumes": [{"path": str(root / "vol0.img")}], "vcpus": 2, "memory": "512M"}


def check_vmm_unit(raw: Raw, name: str, expected_props: dict) -> dict:
    service = raw.props(name)
    for key, value in {**VMM_SETTINGS, **expected_props}.items():
        assert service[key] == value, key
    assert service["ControlGroup"].endswith(f"/kibotos.slice/kibotos-vmm.slice/{name}")
    # Under host memory pressure the kernel picks VMMs before the node (-900).
    assert service["OOMScoreAdjust"] >= 0
    unit = raw.props(name, "Unit")
    for key in NO_STOP_DEPENDENCY:  # systemd's defaults only (basic.target, the slice)
        assert all(u.endswith((".target", ".slice")) for u in unit.get(key, [])), key
    # At host shutdown systemd stops it in its default order (DefaultDependencies).
    assert "shutdown.target" in unit["Conflicts"]
    assert "shutdown.target" in unit["Before"]
    return service


async def test_the_qemu_vmm_unit(sup: Supervisor, raw: Raw, tmp_path: Path):
    backend = pytest.importorskip("kibotos_qemu.backend")
    # A non-root account needs the group kvm; without it, root (explicitly).
    as_user = has_group("kvm")
    options = {"accelerator": "tcg", "user": "nobody" if as_user else "root"}
    vmm = backend.QemuVmm(options)
    await vmm.probe()
    spec = vmm.unit_for(base_launch(tmp_path))
    info = await sup.start(dataclasses.replace(spec, argv=["sleep", "1000"]))
    assert info.main_pid is not None
    service = check_vmm_unit(raw, spec.name, {"LimitMEMLOCK": INFINITY,
                                              "LimitMEMLOCKSoft": INFINITY})
    assert service["WorkingDirectory"] == str(spec.working_directory)
    assert service["StandardOutput"] == service["StandardError"] == "append"
    status = read_status(info.main_pid)
    uid = int(status.split("Uid:")[1].split()[0])
    if as_user:  # the non-root VMM account, with the supplementary group kvm
        assert service["User"] == "nobody"
        assert service["SupplementaryGroups"] == ["kvm"]
        groups = status.split("Groups:")[1].split("\n")[0].split()
        assert uid == 65534
        assert grp.getgrnam("kvm").gr_gid in {int(g) for g in groups}
        assert service["UMask"] == 0o007
    else:
        assert uid == 0
    await sup.stop(spec.name, timeout=5)
    assert await sup.describe(spec.name) is None


async def test_the_qemu_vmm_unit_with_a_network(sup: Supervisor, raw: Raw, tmp_path: Path,
                                               netns_holder: subprocess.Popen):
    """With ``launch["network"]`` the unit runs in the namespace the node made in
    advance (``NetworkNamespacePath``), where QEMU opens the tap by name."""
    backend = pytest.importorskip("kibotos_qemu.backend")
    # Root explicitly: the namespace is what is tested here, not the VMM account.
    vmm = backend.QemuVmm({"accelerator": "tcg", "user": "root"})
    await vmm.probe()
    netns = f"/proc/{netns_holder.pid}/ns/net"
    launch = {**base_launch(tmp_path),
              "network": {"netns_path": netns, "tap": "tap0", "mac": "02:6b:69:00:00:01"}}
    spec = vmm.unit_for(launch)
    assert "tap,id=net0,ifname=tap0,script=no,downscript=no,vhost=off" in spec.argv
    info = await sup.start(dataclasses.replace(spec, argv=["sleep", "1000"]))
    check_vmm_unit(raw, spec.name, {"NetworkNamespacePath": netns})
    assert info.netns_inode == os.stat(netns).st_ino != os.stat("/proc/self/ns/net").st_ino
    await sup.stop(spec.name, timeout=5)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short path: the jail's socket paths must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="fcu-", dir="/tmp"))
    try:
        yield path
    finally:
        jail = pytest.importorskip("kibotos_firecracker.jail")
        for point in jail.mounts_under(path):
            subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


async def test_the_firecracker_vmm_unit(sup: Supervisor, raw: Raw, short_dir: Path,
                                        netns_holder: subprocess.Popen):
    backend = pytest.importorskip("kibotos_firecracker.backend")
    tmp_path = short_dir
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("jailer", "firecracker"):
        (bindir / tool).write_text("#!/bin/sh\necho 'Firecracker v1.17.0-dev (stand-in)'\n")
        (bindir / tool).chmod(0o755)
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir(mode=0o700)
    vmm = backend.FirecrackerVmm({
        "jailer_binary": str(bindir / "jailer"), "firecracker_binary": str(bindir / "firecracker"),
        "uid": 64123, "gid": 64124, "chroot_base_dir": str(sandbox)})
    netns = f"/proc/{netns_holder.pid}/ns/net"
    spec = vmm.unit_for({**base_launch(tmp_path), "netns_path": netns})
    assert spec.argv[0] == str(bindir / "jailer")  # the unit starts the jailer ...
    info = await sup.start(dataclasses.replace(spec, argv=["sleep", "1000"]))
    assert info.main_pid is not None
    service = check_vmm_unit(raw, spec.name, {"NetworkNamespacePath": netns})
    # ... as root (it drops to the VMM account itself), with systemd's default
    # LimitMEMLOCK: Firecracker does not use io_uring.
    assert service["User"] == ""
    default = raw.call("/org/freedesktop/systemd1", "org.freedesktop.DBus.Properties",
                       "Get", "ss", ("org.freedesktop.systemd1.Manager",
                                     "DefaultLimitMEMLOCK"))[0][1]
    assert service["LimitMEMLOCK"] == default != INFINITY
    status = read_status(info.main_pid)
    assert int(status.split("Uid:")[1].split()[0]) == 0
    # The network namespace the node made in advance is the process's.
    assert info.netns_inode == os.stat(netns).st_ino != os.stat("/proc/self/ns/net").st_ino
    await sup.stop(spec.name, timeout=5)
    assert await sup.describe(spec.name) is None


async def test_the_dataplane_unit(sup: Supervisor, raw: Raw):
    """The data-plane unit's properties (``kibotos.node.dataplane.supervisor``): its own
    slice under kibotos.slice, Restart=no, KillMode=control-group, OOMScoreAdjust=-900,
    no stop dependency on the node."""
    from kibotos.node.dataplane.supervisor import UNIT_PROPERTIES, scope_of, unit_name

    name = unit_name(scope_of(Path("/run/kibotos/node")), 1) + ".service"
    info = await sup.start(UnitSpec(name=name, argv=["sleep", "1000"],
                                    properties=UNIT_PROPERTIES))
    assert info.main_pid is not None
    service = raw.props(name)
    assert (service["Type"], service["Restart"], service["KillMode"]) == (
        "exec", "no", "control-group")
    assert service["OOMScoreAdjust"] == -900
    assert service["ControlGroup"].endswith(f"/kibotos.slice/kibotos-dataplane.slice/{name}")
    # root: the guest sockets of both backends are open only to root and the VMM account
    assert service["User"] == ""
    assert int(read_status(info.main_pid).split("Uid:")[1].split()[0]) == 0
    unit = raw.props(name, "Unit")
    for key in NO_STOP_DEPENDENCY:
        assert all(u.endswith((".target", ".slice")) for u in unit.get(key, [])), key
    await sup.stop(name, timeout=5)
