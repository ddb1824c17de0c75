"""`QemuVmm`, the ``qemu`` VMM backend: microvm guests under KVM where it works, else TCG.

Backend options (the node passes its ``[vmm.qemu]`` table; all optional)::

    qemu_binary    path or name      default qemu-system-x86_64 (looked up on PATH)
    accelerator    auto | kvm | tcg  default auto: KVM only if the probe guest boots
    platform_dir   path              Platform whose kernel boots the KVM probe guest
    cache_dir      path              where the probe answer is cached (per host boot)
    probe_timeout  seconds           default 20
    user           account           default kibotos-vmm: QEMU runs as this account, with
                                     the supplementary group kvm; "root" only on the
                                     operator's explicit request (a startup warning)
    python         path              interpreter of the no-THP wrapper (default: ours)
    proc_root      path              where /proc/cpuinfo is read (tests)

Non-root by default (spec: node-and-vmm-processes, "VMM service": the KiboVM service
"runs directly as the non-root VMM account, with the supplementary group kvm").  What
such a QEMU opens is handed to the account by the node: the pools' block files are
``root:kibotos-vmm`` 0660, the Instance directory (sockets, console log, the linked
Template image and kernel) ``root:kibotos-vmm`` 1770 on a traversable path
(`kibotos.node.host.vmm_access`); its stdout log is opened by the supervisor.  The
unit's ``UMask=0007`` keeps the sockets and logs QEMU creates from other local users.
This backend has no network devices yet, so there is no tap file descriptor to hand
over.  An account that does not exist makes `probe` fail (the node refuses creates and
says why).

Readiness: `wait_ready` connects to the agent socket (retrying: the socket file exists
before QEMU listens) and waits for the agent's hello, all within ``timeout``.  It never
kills anything on timeout; the caller stops the unit (the spec's "kill on timeout" is
the node's job, through its supervisor).  `guest_channel` gives the raw stream for
`kibotos.sdk.guest.open_guest_channel`.
"""

from __future__ import annotations

import pwd
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import trio

from kibotos.sdk import (
    FailedPrecondition,
    UnitSpec,
    VmmBackend,
    backend_options,
    default_cache_root,
)
from kibotos.sdk.guest import connect_unix_with_retry
from kibotos_qemu import cmdline, probe
from kibotos_qemu.launch import Launch, parse_launch
from kibotos_qemu.ready import wait_hello

#: systemd properties of the VMM service (spec, "VMM service"; the KiboVM row).
UNIT_PROPERTIES: Mapping[str, Any] = {
    "Type": "exec",
    "Restart": "no",
    "KillMode": "control-group",
    "OOMPolicy": "kill",
    "Slice": "kibotos-vmm.slice",
    "LimitMEMLOCK": "infinity",
    "PrivateMounts": False,
}
DEFAULT_USER = "kibotos-vmm"
#: What `probe` reports (and the node logs at startup) when QEMU runs as root.
ROOT_WARNING = ("[vmm.qemu] user = \"root\": QEMU runs as root, not as the non-root VMM "
                "account; a guest that escapes QEMU owns the host")
_OPTIONS = {"qemu_binary", "accelerator", "platform_dir", "cache_dir", "probe_timeout",
            "user", "python", "proc_root"}


class QemuVmm(VmmBackend):
    """Turns a launch description into a QEMU microvm unit; see the module docstring."""

    name: ClassVar[str] = "qemu"
    CAN_KVM: ClassVar[bool] = True
    CAN_TCG: ClassVar[bool] = True
    CAN_VSOCK: ClassVar[bool] = False
    CAN_NETWORK: ClassVar[bool] = True
    #: Mounted by the Platform init before the agent starts (the writable layer's ext4);
    #: the node hands them to the agent's ``configure`` so ``stop_prepare`` freezes them.
    GUEST_RETAINED_FILESYSTEMS: ClassVar[tuple[str, ...]] = ("/run/kibotos/rw",)

    def __init__(self, options: Mapping[str, Any]) -> None:
        opts = backend_options("vmm", self.name, options, _OPTIONS)
        binary = opts.text("qemu_binary", "qemu-system-x86_64")
        self.qemu_binary = shutil.which(binary) or binary
        accel = opts.choice("accelerator", "auto", ("auto", *cmdline.ACCELERATORS))
        self.accelerator_option = accel
        self.accelerator: str | None = None if accel == "auto" else accel
        self.platform_dir = opts.path_or_none("platform_dir")
        self.cache_dir = opts.path("cache_dir", default_cache_root() / "qemu")
        self.probe_timeout = opts.seconds("probe_timeout", 20.0)
        self.user = opts.text("user", DEFAULT_USER)
        self.python = opts.text_or_none("python")
        self.proc_root = opts.path("proc_root", "/proc")
        self.probed: Mapping[str, Any] | None = None

    # ------------------------------------------------------------------ probe

    def qemu_version(self) -> str | None:
        try:
            out = subprocess.run([self.qemu_binary, "--version"], capture_output=True,
                                 text=True, timeout=30, check=False).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
        first = out.splitlines()[0] if out else ""
        return first.removeprefix("QEMU emulator version ").strip() or None

    async def probe(self) -> Mapping[str, Any]:
        """Which accelerator this host runs guests with, and why (for ``kibo node get``
        and the node log).  KVM needs a real probe boot (see `kibotos_qemu.probe`)."""
        warnings = self.check_account()
        version = await trio.to_thread.run_sync(self.qemu_version)
        if version is None:
            raise FailedPrecondition(f"qemu backend: {self.qemu_binary} does not run "
                                     "(is qemu-system-x86 installed?)")
        if self.accelerator_option == "tcg":
            kvm: Mapping[str, Any] = {"usable": False, "reason": "accelerator=tcg configured",
                                      "seconds": 0.0, "cached": False}
        else:
            vmlinux = initramfs = None
            if self.platform_dir is not None:
                vmlinux = self.platform_dir / "vmlinux"
                initramfs = self.platform_dir / "initramfs"
            kvm = await probe.probe_kvm(qemu_binary=self.qemu_binary, vmlinux=vmlinux,
                                        initramfs=initramfs, cache_dir=self.cache_dir,
                                        timeout=self.probe_timeout)
        if self.accelerator_option == "kvm" and not kvm["usable"]:
            raise FailedPrecondition(f"qemu backend: accelerator=kvm configured, but KVM "
                                     f"is not usable here: {kvm['reason']}")
        self.accelerator = "kvm" if kvm["usable"] else "tcg"
        self.probed = {
            "backend": self.name,
            "accelerator": self.accelerator,
            "kvm": dict(kvm),
            "qemu": {"binary": self.qemu_binary, "version": version},
            "host_cpu_mhz": self.host_mhz(),
            "user": self.user,
            "warnings": warnings,
        }
        return self.probed

    def check_account(self) -> list[str]:
        """The account QEMU runs as must exist; root is allowed, with a warning."""
        try:
            entry = pwd.getpwnam(self.user)
        except KeyError:
            raise FailedPrecondition(
                f"qemu backend: the VMM account {self.user!r} does not exist (the "
                "kibotos-node package creates kibotos-vmm; or set [vmm.qemu] user)"
            ) from None
        return [ROOT_WARNING] if entry.pw_uid == 0 else []

    def host_mhz(self) -> int | None:
        try:
            return cmdline.host_cpu_mhz((self.proc_root / "cpuinfo").read_text())
        except OSError:
            return None

    # ------------------------------------------------------------------ launch

    def parse(self, launch: Mapping[str, Any]) -> Launch:
        return parse_launch(launch)

    def argv_for(self, launch: Mapping[str, Any]) -> list[str]:
        """The unit's whole command: the no-THP wrapper, then QEMU and its arguments."""
        if self.accelerator is None:
            raise FailedPrecondition("qemu backend: probe() must run before the first "
                                     "launch (accelerator=auto)")
        if not Path(self.qemu_binary).is_absolute():
            raise FailedPrecondition(f"qemu backend: {self.qemu_binary} not found on PATH "
                                     "(is qemu-system-x86 installed?)")
        spec = parse_launch(launch)
        args = cmdline.qemu_args(spec, self.accelerator, self.host_mhz())
        return cmdline.wrapped_argv(self.qemu_binary, args, self.python)

    def unit_for(self, launch: Mapping[str, Any]) -> UnitSpec:
        spec = parse_launch(launch)
        props = dict(UNIT_PROPERTIES)
        props["Description"] = f"kibotos VMM (qemu) for {spec.instance_id}"
        if self.user != "root":
            props["User"] = self.user
            props["SupplementaryGroups"] = ["kvm"]
            props["UMask"] = 0o007
        if spec.network is not None:  # QEMU opens the node's tap in there, by name
            props["NetworkNamespacePath"] = str(spec.network.netns_path)
        return UnitSpec(
            name=spec.unit_name,
            argv=self.argv_for(launch),
            properties=props,
            environment={},
            working_directory=spec.runtime_dir,
            log_path=spec.vmm_log,
        )

    def tap_owner(self) -> tuple[int | None, int | None]:
        """Who owns the guest's tap, so QEMU attaches to it by name without
        ``CAP_NET_ADMIN``: the ``user`` account (root when none is configured)."""
        if not self.user:
            return None, None
        try:
            account = pwd.getpwnam(self.user)
        except KeyError:
            raise FailedPrecondition(f"qemu backend: user {self.user!r} does not exist "
                                     "on this host") from None
        return account.pw_uid, account.pw_gid

    def volume_devices(self, launch: Mapping[str, Any]) -> list[str]:
        """The guest device path of each Volume of `launch`, in order, for the agent's
        ``configure`` (``/dev/disk/by-id/virtio-<serial>``, linked by the Platform init;
        device names like ``vdc`` depend on probe order and are never used)."""
        return [f"/dev/disk/by-id/virtio-{v.serial}" for v in parse_launch(launch).volumes]

    # ------------------------------------------------------------------ guest

    async def guest_channel(self, launch: Mapping[str, Any], *, timeout: float = 10.0
                            ) -> trio.SocketStream:
        """A byte stream to the guest agent, for `kibotos.sdk.guest.open_guest_channel`.

        QEMU's socket chardev serves one client at a time: the stream owns the channel
        until it is closed."""
        spec = parse_launch(launch)
        return await connect_unix_with_retry(spec.agent_socket, trio.current_time() + timeout)

    async def wait_ready(self, launch: Mapping[str, Any], *, timeout: float
                         ) -> Mapping[str, Any]:
        """The agent's hello as `GuestInfo.to_json()` (boot ID, protocol version,
        capabilities …), once it arrives.

        Connects (retrying while QEMU does not listen yet), opens a guest session, and
        closes it again after the hello.  Raises DeadlineExceeded after `timeout`
        seconds, with the guest console's last lines; it never kills anything: on a
        timeout the caller stops the unit through its supervisor."""
        spec = parse_launch(launch)
        info = await wait_hello(spec.agent_socket, spec.console_log,
                                trio.current_time() + timeout)
        return info.to_json()
