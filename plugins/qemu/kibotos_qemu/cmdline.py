"""The QEMU command line for one launch, and the kernel command line it boots with.

Every flag below comes from a measurement in shared/TESTBED.md (repeated with the
reason in docs/vm.md):

* ``-M microvm`` boots the Platform's ELF vmlinux through its PVH note; its virtio-mmio
  devices are announced by ACPI, which is why ACPI stays on.
* TCG: ``-cpu qemu64,+arat`` (idle guest 0.5 % of a core instead of 4 %) and
  ``tsc_early_khz=<host MHz × 1000> tsc=reliable`` on the kernel command line (without
  them 6 of 10 concurrent boots hung); ``-accel tcg,tb-size=32`` keeps the translation
  cache from costing a gigabyte; ``mitigations=off audit=0 8250.nr_uarts=1
  cryptomgr.notests`` cut the boot from 3.6 s to 2.75 s.  KVM: ``-cpu host`` and none
  of the TSC trims (the guest gets kvmclock).
* Disks: ``cache=unsafe,aio=threads``: buffered I/O, and a guest flush is not a host
  fsync (spec, storage pools, Notes: a guest fsync reaches the host page cache; the
  node fsyncs the block file when it releases or fences it, so no COMMIT per guest
  fsync on NFS); the Template read-only; ``discard=off`` (no DISCARD for the guest:
  block files are never hole-punched).  Each disk carries a
  virtio serial by which the guest init finds it.
* The agent channels: virtio-serial port ``org.kibotos.agent.0`` (the node's) on
  ``agent.sock`` and ``org.kibotos.agent.1`` (the data plane's) on ``agent-dp.sock``,
  unix sockets that QEMU listens on (``server=on,wait=off``: QEMU does not wait for the
  host side).  The guest agent serves both (``kibotos.port=`` lists them).
* ``virtio-balloon-device,free-page-reporting=on``: the only way used guest memory
  returns to the host.
* With a network: ``-netdev tap,ifname=<tap>,script=no,downscript=no,vhost=off`` and
  ``-device virtio-net-device,netdev=net0,mac=<mac>``.  QEMU runs in the Instance's
  namespace (the unit's ``NetworkNamespacePath``) and opens the node's persistent tap
  there by name: the tap is owned by the VMM account, so attaching needs no capability,
  and no script runs (QEMU configures nothing; the node did).  No vhost-net: its
  device is privileged.  ``kibotos.net=1`` makes the init load virtio-net.
* ``-no-reboot`` with ``panic=-1``: a guest that panics, or whose init (tini, hence the
  agent) exits, ends the QEMU process, so the unit ends and the node sees it.
* ``PR_SET_THP_DISABLE`` before exec: an idle 256 MiB guest then costs ~230 MiB RSS.
  Set by a tiny ``python3 -I -S -c`` wrapper (`NOTHP_WRAPPER`) that execs QEMU, so the
  unit's main process *is* QEMU (``Type=exec``) and inherits the prctl.
"""

from __future__ import annotations

import sys

from kibotos_qemu.launch import AGENT_PORT, DATAPLANE_PORT, ROOT_SERIAL, RW_SERIAL, Launch

ACCELERATORS = ("kvm", "tcg")

#: Runs as ``python3 -I -S -c NOTHP_WRAPPER <qemu> <args…>``: prctl, then exec QEMU.
#: -I -S: no site, no user paths, no environment: ~10 ms, and nothing to hijack it.
NOTHP_WRAPPER = (
    "import ctypes,os,sys\n"
    "libc=ctypes.CDLL(None,use_errno=True)\n"
    "if libc.prctl(41,1,0,0,0)!=0:\n"  # PR_SET_THP_DISABLE
    " sys.exit('prctl(PR_SET_THP_DISABLE): '+os.strerror(ctypes.get_errno()))\n"
    "os.execv(sys.argv[1],sys.argv[1:])\n"
)

#: Kernel arguments under TCG besides the TSC ones (TESTBED: ready 3.6 s -> 2.75 s).
TCG_TRIMS = ("mitigations=off", "audit=0", "8250.nr_uarts=1", "cryptomgr.notests")


def kernel_cmdline(launch: Launch, accel: str, host_mhz: int | None) -> str:
    """The kernel command line (the init's own ``kibotos.*`` parameters included)."""
    args = ["console=ttyS0", "panic=-1", "quiet"]
    if accel == "tcg":
        if host_mhz:
            args.append(f"tsc_early_khz={host_mhz * 1000}")
        args += ["tsc=reliable", *TCG_TRIMS]
    args += [f"kibotos.port={AGENT_PORT},{DATAPLANE_PORT}", f"kibotos.root={ROOT_SERIAL}",
             f"kibotos.rw={RW_SERIAL}", f"kibotos.disks={2 + len(launch.volumes)}"]
    if launch.network is not None:
        args.append("kibotos.net=1")
    args += launch.kernel_args
    return " ".join(args)


def _drive(name: str, path: str, serial: str, read_only: bool) -> list[str]:
    ro = ",read-only=on" if read_only else ""
    return [
        "-drive",
        f"id={name},file={_opt(path)},format=raw,if=none,cache=unsafe,aio=threads{ro}",
        # discard=off: the guest is not offered DISCARD (spec, storage pools: block
        # files are never hole-punched; the device property defaults to on).
        "-device", f"virtio-blk-device,drive={name},serial={serial},discard=off",
    ]


def _opt(value: str) -> str:
    """QEMU option values escape a comma by doubling it."""
    return value.replace(",", ",,")


def qemu_args(launch: Launch, accel: str, host_mhz: int | None) -> list[str]:
    """QEMU's arguments (without the binary) for `launch` under `accel`."""
    if accel not in ACCELERATORS:
        raise ValueError(f"accelerator {accel!r}")
    args = [
        "-name", f"kibotos-{launch.instance_id}",
        "-M", "microvm",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
    ]
    if accel == "kvm":
        args += ["-accel", "kvm", "-cpu", "host"]
    else:
        args += ["-accel", "tcg,tb-size=32", "-cpu", "qemu64,+arat"]
    args += [
        "-smp", str(launch.vcpus),
        "-m", f"{launch.memory_bytes >> 20}M",
        "-kernel", str(launch.vmlinux),
        "-initrd", str(launch.initramfs),
        "-append", kernel_cmdline(launch, accel, host_mhz),
        "-chardev", f"file,id=console,path={_opt(str(launch.console_log))}",
        "-serial", "chardev:console",
        "-qmp", f"unix:{_opt(str(launch.qmp_socket))},server=on,wait=off",
    ]
    args += _drive("template", str(launch.template_image), ROOT_SERIAL, True)
    args += _drive("rw", str(launch.writable_layer), RW_SERIAL, False)
    for i, vol in enumerate(launch.volumes):
        args += _drive(f"vol{i}", str(vol.path), vol.serial, vol.read_only)
    args += [
        "-device", "virtio-serial-device",
        "-chardev", f"socket,id=agent,path={_opt(str(launch.agent_socket))},server=on,wait=off",
        "-device", f"virtserialport,chardev=agent,name={AGENT_PORT}",
        "-chardev",
        f"socket,id=agentdp,path={_opt(str(launch.dataplane_socket))},server=on,wait=off",
        "-device", f"virtserialport,chardev=agentdp,name={DATAPLANE_PORT}",
        "-device", "virtio-balloon-device,free-page-reporting=on",
    ]
    net = launch.network
    if net is not None:
        args += [
            "-netdev", f"tap,id=net0,ifname={net.tap},script=no,downscript=no,vhost=off",
            "-device", f"virtio-net-device,netdev=net0,mac={net.mac}",
        ]
    return args


def wrapped_argv(qemu_binary: str, args: list[str], python: str | None = None) -> list[str]:
    """The unit's argv: the no-THP wrapper running `qemu_binary` with `args`."""
    return [python or sys.executable, "-I", "-S", "-c", NOTHP_WRAPPER, qemu_binary, *args]


def host_cpu_mhz(cpuinfo: str) -> int | None:
    """The first ``cpu MHz`` of /proc/cpuinfo, rounded; None when the host has none."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "cpu MHz":
            try:
                return round(float(value))
            except ValueError:
                return None
    return None
