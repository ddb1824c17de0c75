"""`FirecrackerVmm`, the ``firecracker`` VMM backend: Firecracker started through its jailer.

Backend options (the node passes its ``[vmm.firecracker]`` table; all optional)::

    jailer_binary       path or name   default jailer (looked up on PATH)
    firecracker_binary  path or name   default firecracker (looked up on PATH)
    user                account        the VMM account; default kibotos-vmm
    uid, gid            integers       the VMM account by number instead (both)
    chroot_base_dir     path           the shared sandbox root; default /srv/jailer
    vsock_port          integer        the agent's vsock port in the guest; default 1024
    guest_cid           integer >= 3   the guest's vsock CID; default 3
    balloon             bool           free page reporting balloon; default true
    kvm_device          path           default /dev/kvm (tests)

Lifecycle, as the node drives it: `unit_for` stages the jail (`kibotos_firecracker.jail`)
and returns the jailer's unit, which runs as root; the jailer drops to the VMM account
and execs Firecracker, which waits on its API socket.  `wait_ready` then configures the
microVM over that socket, starts it, and waits for the agent's hello over vsock.  It
skips the configuration when Firecracker already runs a guest, so a second call (a
restarted node) only waits for the hello.  After the unit stopped, `release` removes
the jail (the spec counts a jail left behind as a leftover).
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import trio

from kibotos.sdk import (
    BackendOptions,
    FailedPrecondition,
    UnitSpec,
    VmmBackend,
    backend_options,
    procfs,
)
from kibotos_firecracker import jail as jailmod
from kibotos_firecracker.api import FirecrackerApi, launch_calls
from kibotos_firecracker.launch import Launch, parse_launch
from kibotos_firecracker.ready import wait_hello
from kibotos_firecracker.vsock import connect_vsock

#: The data plane's agent socket in the Instance directory (kibotos.node.dataplane.targets).
DATAPLANE_SOCKET = "agent-dp.sock"

#: systemd properties of the VMM service (spec, "VMM service"): runs as root (the
#: jailer drops privileges itself), and keeps the default LimitMEMLOCK, since
#: Firecracker does not use io_uring (its drives are io_engine Sync).
UNIT_PROPERTIES: Mapping[str, Any] = {
    "Type": "exec",
    "Restart": "no",
    "KillMode": "control-group",
    "OOMPolicy": "kill",
    "Slice": "kibotos-vmm.slice",
    "PrivateMounts": False,
}
DEFAULT_USER = "kibotos-vmm"
DEFAULT_CHROOT_BASE = "/srv/jailer"
DEFAULT_VSOCK_PORT = 1024
_OPTIONS = {"jailer_binary", "firecracker_binary", "user", "uid", "gid", "chroot_base_dir",
            "vsock_port", "guest_cid", "balloon", "kvm_device"}


def _account(opts: BackendOptions) -> tuple[int, int]:
    if "uid" in opts or "gid" in opts:
        if "user" in opts:
            raise opts.invalid("user", "give either user or uid and gid")
        return opts.integer("uid", -1, 1, 2**32 - 2), opts.integer("gid", -1, 0, 2**32 - 2)
    user = opts.text("user", DEFAULT_USER)
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise FailedPrecondition(
            f"firecracker backend: the VMM account {user!r} does not exist (create it, or "
            "set user, or uid and gid, in [vmm.firecracker])") from None
    if entry.pw_uid == 0:
        raise opts.invalid("user", "is root; the jail needs an unprivileged account")
    return entry.pw_uid, entry.pw_gid


def _version(binary: str) -> str | None:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = out.strip().splitlines()[0] if out.strip() else ""
    return first or None


def _fs_type(path: Path, proc: Path = procfs.PROC) -> str | None:
    """The file system type of the mount that holds `path`."""
    try:
        mount = procfs.find_mount(procfs.read_mountinfo(proc), os.path.realpath(path))
    except OSError:
        return None
    return mount.fstype if mount is not None else None


class FirecrackerVmm(VmmBackend):
    """Turns a launch description into a jailer unit; see the module docstring."""

    name: ClassVar[str] = "firecracker"
    CAN_KVM: ClassVar[bool] = True
    CAN_TCG: ClassVar[bool] = False
    CAN_VSOCK: ClassVar[bool] = True
    CAN_NETWORK: ClassVar[bool] = True
    #: Mounted by the Platform init before the agent starts (docs/vm.md).
    GUEST_RETAINED_FILESYSTEMS: ClassVar[tuple[str, ...]] = ("/run/kibotos/rw",)

    def __init__(self, options: Mapping[str, Any]) -> None:
        opts = backend_options("vmm", self.name, options, _OPTIONS)
        jailer = opts.text("jailer_binary", "jailer")
        self.jailer_binary = shutil.which(jailer) or jailer
        firecracker = opts.text("firecracker_binary", "firecracker")
        self.firecracker_binary = shutil.which(firecracker) or firecracker
        self.uid, self.gid = _account(opts)
        self.chroot_base_dir = opts.path("chroot_base_dir", DEFAULT_CHROOT_BASE,
                                         absolute=True)
        self.vsock_port = opts.integer("vsock_port", DEFAULT_VSOCK_PORT, 1, 2**32 - 2)
        self.guest_cid = opts.integer("guest_cid", 3, 3, 2**32 - 2)
        self.balloon = opts.flag("balloon", True)
        self.kvm_device = opts.path("kvm_device", "/dev/kvm")
        self.probed: Mapping[str, Any] | None = None

    # ------------------------------------------------------------------ probe

    def _sandbox_root(self) -> Mapping[str, Any]:
        """Create the sandbox root if missing; refuse one others can enter.  The spec
        wants a root-owned tmpfs with mode 0700 (then every file is bind-mounted into
        the jails; on the pools' file system they are hard-linked)."""
        base = self.chroot_base_dir
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = base.stat()
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise FailedPrecondition(f"firecracker backend: chroot_base_dir {base} has mode "
                                     f"{mode:04o}; it must be 0700")
        if os.geteuid() == 0 and st.st_uid != 0:
            raise FailedPrecondition(f"firecracker backend: chroot_base_dir {base} is owned "
                                     f"by uid {st.st_uid}, not root")
        fstype = _fs_type(base)
        return {"path": str(base), "mode": f"{mode:04o}", "owner_uid": st.st_uid,
                "fs_type": fstype, "tmpfs": fstype == "tmpfs"}

    def _kvm(self) -> Mapping[str, Any]:
        try:
            fd = os.open(self.kvm_device, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            return {"usable": False, "reason": f"{self.kvm_device}: {exc.strerror}"}
        os.close(fd)
        return {"usable": True, "reason": f"{self.kvm_device} opens read-write"}

    async def probe(self) -> Mapping[str, Any]:
        """The binaries' versions, KVM, the sandbox root and the VMM account (for
        ``kibo node get`` and the node log).  Firecracker has no emulation: without a
        usable KVM device no guest can run, and the node should not start."""
        versions = {}
        for label, binary in (("jailer", self.jailer_binary),
                              ("firecracker", self.firecracker_binary)):
            version = await trio.to_thread.run_sync(_version, binary)
            if version is None:
                raise FailedPrecondition(f"firecracker backend: {binary} does not run "
                                         f"(is {label} installed?)")
            versions[label] = {"binary": binary, "version": version}
        kvm = self._kvm()
        if not kvm["usable"]:
            raise FailedPrecondition(f"firecracker backend: KVM is not usable: "
                                     f"{kvm['reason']}")
        sandbox = await trio.to_thread.run_sync(self._sandbox_root)
        self.probed = {
            "backend": self.name,
            "accelerator": "kvm",
            "kvm": kvm,
            **versions,
            "sandbox_root": sandbox,
            "vmm_account": {"uid": self.uid, "gid": self.gid},
        }
        return self.probed

    # ------------------------------------------------------------------ launch

    def jail_for(self, spec: Launch) -> jailmod.Jail:
        exec_name = Path(self.firecracker_binary).resolve().name
        return jailmod.Jail(self.chroot_base_dir, exec_name, spec.instance_id)

    def argv_for(self, spec: Launch) -> list[str]:
        for label, binary in (("jailer", self.jailer_binary),
                              ("firecracker", self.firecracker_binary)):
            if not Path(binary).is_absolute():
                raise FailedPrecondition(f"firecracker backend: {binary} not found on PATH "
                                         f"(is {label} installed?)")
        unit_cgroup = f"{jailmod.slice_cgroup(UNIT_PROPERTIES['Slice'])}/{spec.unit_name}"
        return jailmod.jailer_argv(
            jailer=self.jailer_binary, firecracker=self.firecracker_binary,
            jail=self.jail_for(spec), uid=self.uid, gid=self.gid, unit_cgroup=unit_cgroup,
            netns=spec.netns_path)

    def unit_for(self, launch: Mapping[str, Any]) -> UnitSpec:
        """The jailer's unit for `launch`, after staging its jail (links or bind mounts
        of the kernel, initramfs, Template, writable layer and Volumes; the writable
        layer and Volumes handed to the VMM account).  Call it right before starting
        the unit: a leftover jail of the same Instance is replaced, and one whose
        Firecracker still answers is refused."""
        spec = parse_launch(launch)
        argv = self.argv_for(spec)
        jail = self.jail_for(spec)
        jailmod.stage(jail, jailmod.jail_files(spec), uid=self.uid, gid=self.gid)
        # The data plane reaches the guest through the Instance's agent-dp.sock, as with
        # every backend: here a link to the vsock socket (it then sends CONNECT
        # <dataplane_vsock_port> on each connection).
        link = spec.runtime_dir / DATAPLANE_SOCKET
        tmp = link.with_name(f".{DATAPLANE_SOCKET}.tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(jail.vsock_socket)
        tmp.replace(link)
        props = dict(UNIT_PROPERTIES)
        props["Description"] = f"kibotos VMM (firecracker) for {spec.instance_id}"
        if spec.netns_path is not None:
            # The jailer joins it too (--netns); with the unit already in it, the
            # namespace the supervisor records at start is the VMM's from the outset.
            props["NetworkNamespacePath"] = str(spec.netns_path)
        return UnitSpec(
            name=spec.unit_name,
            argv=argv,
            properties=props,
            environment={},
            working_directory=spec.runtime_dir,
            log_path=spec.vmm_log,
        )

    def tap_owner(self) -> tuple[int | None, int | None]:
        """The VMM account owns the guest's tap: Firecracker, dropped to it by the
        jailer, attaches to the tap by name (``host_dev_name``) with no capability."""
        return self.uid, self.gid

    def volume_devices(self, launch: Mapping[str, Any]) -> list[str]:
        """The guest device path of each Volume of `launch`, in order, for the agent's
        ``configure``: ``/dev/disk/by-id/virtio-<serial>`` with the serial Firecracker
        derives from the file (`kibotos_firecracker.jail.guest_serial`)."""
        return [f"/dev/disk/by-id/virtio-{jailmod.guest_serial(v.path)}"
                for v in parse_launch(launch).volumes]

    async def release(self, launch: Mapping[str, Any]) -> None:
        """Remove the jail of `launch` (unmount, delete) once its unit has stopped."""
        spec = parse_launch(launch)
        await trio.to_thread.run_sync(jailmod.release, self.jail_for(spec))

    # ------------------------------------------------------------------ guest

    async def configure(self, launch: Mapping[str, Any], deadline: float) -> str:
        """Configure and start the microVM over the API unless it runs already; returns
        the state Firecracker reported before (``Not started``, ``Running`` …)."""
        spec = parse_launch(launch)
        jail = self.jail_for(spec)
        files = jailmod.jail_files(spec)
        serials = await trio.to_thread.run_sync(jailmod.guest_serials, files)
        calls = launch_calls(spec, files, serials, vsock_port=self.vsock_port,
                             guest_cid=self.guest_cid, balloon=self.balloon)
        async with FirecrackerApi(jail.api_socket, deadline) as api:
            info = await api.wait_answering()
            state = str(info.get("state"))
            if state == "Not started":
                await api.run(calls)
        return state

    @property
    def dataplane_vsock_port(self) -> int:
        """The guest port the data plane connects to through ``agent-dp.sock``."""
        return self.vsock_port

    async def guest_channel(self, launch: Mapping[str, Any], *, timeout: float = 10.0
                            ) -> trio.SocketStream:
        """A byte stream to the guest agent over vsock, for
        `kibotos.sdk.guest.open_guest_channel`; each call is a new guest connection."""
        spec = parse_launch(launch)
        return await connect_vsock(self.jail_for(spec).vsock_socket, self.vsock_port,
                                   trio.current_time() + timeout)

    async def wait_ready(self, launch: Mapping[str, Any], *, timeout: float
                         ) -> Mapping[str, Any]:
        """Configure and start the microVM, then the agent's hello as
        `GuestInfo.to_json()`.  API refusals are FailedPrecondition naming the call
        and Firecracker's ``fault_message``; DeadlineExceeded after `timeout` seconds.
        Never stops the unit: on failure the caller does."""
        spec = parse_launch(launch)
        deadline = trio.current_time() + timeout
        await self.configure(launch, deadline)
        uds = self.jail_for(spec).vsock_socket
        info = await wait_hello(lambda: connect_vsock(uds, self.vsock_port, deadline),
                                spec.vmm_log, deadline)
        return info.to_json()
