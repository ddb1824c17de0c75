"""The launch description the ``firecracker`` backend reads, checked before anything runs.

The same mapping the ``qemu`` backend takes (docs/vm.md, "Launch description"), so the
node drives both alike, with two differences that Firecracker imposes::

    instance_id     str, required    also the jailer's --id: 1-64 letters, digits, '-'
    unit_name       str              default kibotos-vmm-<instance_id>.service
    runtime_dir     abs path, req.   vmm.log (Firecracker's output and the guest console)
    platform_dir    abs path, req.   a Platform: vmlinux, initramfs
    template_image  abs path, req.   the Template image, attached read-only
    writable_layer  abs path, req.   the writable layer (ext4), read-write
    volumes         list             [{"path": abs path, "read_only"?: bool}]
    vcpus           int 1..32        default 1 (Firecracker's range)
    memory          int bytes or "512M"   default 256 MiB; at least 64 MiB, whole MiB
    kernel_args     list of str      appended to the kernel command line
    netns_path      abs path         network namespace the VMM joins (jailer --netns)
    taps            list             [{"host_dev_name": str, "guest_mac"?: str, "mtu"?: int}]
    network         object           what the node gives every backend (docs/vm.md):
                                     {"netns_path", "tap", "mac"}; the same as netns_path
                                     and one tap (not together with them)

A Volume ``serial`` is refused: Firecracker gives every disk a serial made of the
backing file's device and inode numbers and has no way to set another one
(`kibotos_firecracker.jail.guest_serial`).  ``netns_path`` and ``taps`` are accepted,
unlike under ``qemu``, because the jailer joins a namespace and Firecracker attaches
taps by name natively.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kibotos.sdk import InvalidArgument, vmm_launch

#: Firecracker's vCPU range (swagger: MachineConfiguration.vcpu_count, 1..32).
MAX_VCPUS = 32

#: The jailer's rule for --id (docs/jailer.md): alphanumeric and hyphens, 1-64.
_JAIL_ID = re.compile(r"[A-Za-z0-9-]{1,64}")
#: A Linux interface name: at most 15 bytes, no '/', ':' or whitespace.
_IFNAME = re.compile(r"[A-Za-z0-9_.-]{1,15}")
_MAC = re.compile(r"[0-9a-fA-F]{2}(?::[0-9a-fA-F]{2}){5}")
_KNOWN = {"instance_id", "unit_name", "runtime_dir", "platform_dir", "template_image",
          "writable_layer", "volumes", "vcpus", "memory", "kernel_args", "netns_path",
          "taps", "network"}


@dataclass(frozen=True)
class Volume:
    path: Path
    read_only: bool = False


@dataclass(frozen=True)
class Tap:
    host_dev_name: str
    guest_mac: str | None = None
    mtu: int | None = None


@dataclass(frozen=True)
class Launch(vmm_launch.BaseLaunch[Volume]):
    """`vmm_log` holds Firecracker's log and the serial console."""

    netns_path: Path | None
    taps: tuple[Tap, ...]

    @property
    def memory_mib(self) -> int:
        return self.memory_bytes >> 20


def _volumes(launch: Mapping[str, Any]) -> tuple[Volume, ...]:
    out: list[Volume] = []
    for i, item in vmm_launch.objects(launch, "volumes"):
        if "serial" in item:
            raise InvalidArgument(
                f"launch: volumes[{i}].serial cannot be set under Firecracker (the guest "
                "sees a serial made of the file's device and inode numbers; "
                "FirecrackerVmm.volume_devices() lists the guest paths)")
        vmm_launch.item_keys(item, {"path", "read_only"}, f"volumes[{i}]")
        path = vmm_launch.abs_path(item, "path", must_exist="file", label=f"volumes[{i}].path")
        read_only = vmm_launch.read_only(item, i)
        out.append(Volume(path, read_only))
    return tuple(out)


def _taps(launch: Mapping[str, Any]) -> tuple[Tap, ...]:
    out: list[Tap] = []
    for i, item in vmm_launch.objects(launch, "taps"):
        vmm_launch.item_keys(item, {"host_dev_name", "guest_mac", "mtu"}, f"taps[{i}]")
        name = item.get("host_dev_name")
        if not isinstance(name, str) or not _IFNAME.fullmatch(name):
            raise InvalidArgument(f"launch: taps[{i}].host_dev_name {name!r} must be an "
                                  "interface name of 1-15 letters, digits, '_', '.', '-'")
        if name in {t.host_dev_name for t in out}:
            raise InvalidArgument(f"launch: taps[{i}].host_dev_name {name!r} is used twice")
        mac = item.get("guest_mac")
        if mac is not None and (not isinstance(mac, str) or not _MAC.fullmatch(mac)):
            raise InvalidArgument(f"launch: taps[{i}].guest_mac {mac!r} must look like "
                                  "06:00:ac:10:00:02")
        mtu = item.get("mtu")
        if mtu is not None and (isinstance(mtu, bool) or not isinstance(mtu, int)
                                or not 68 <= mtu <= 65535):
            raise InvalidArgument(f"launch: taps[{i}].mtu must be an integer from 68 to "
                                  f"65535, not {mtu!r}")
        out.append(Tap(name, mac.lower() if mac else None, mtu))
    return tuple(out)


def parse_launch(launch: Mapping[str, Any]) -> Launch:
    """Check every key of `launch`; the files it names must exist (a missing image is
    clearer here than as an API error after the unit started)."""
    vmm_launch.check_keys(launch, _KNOWN)
    instance_id = launch.get("instance_id")
    if not isinstance(instance_id, str) or not _JAIL_ID.fullmatch(instance_id):
        raise InvalidArgument(f"launch: instance_id {instance_id!r} must be 1-64 letters, "
                              "digits or '-' (it is the jailer's --id)")
    base = vmm_launch.base_fields(launch, instance_id, MAX_VCPUS, lambda: _volumes(launch))
    netns = None
    if launch.get("netns_path") is not None:
        netns = vmm_launch.abs_path(launch, "netns_path", must_exist="any")
    taps = _taps(launch)
    network = vmm_launch.network(launch)
    if network is not None:
        if netns is not None or taps:
            raise InvalidArgument("launch: network comes instead of netns_path and taps, "
                                  "not with them")
        netns, taps = network.netns_path, (Tap(network.tap, network.mac),)
    return Launch(**base, netns_path=netns, taps=taps)
