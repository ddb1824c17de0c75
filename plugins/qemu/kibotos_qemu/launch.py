"""The launch description the ``qemu`` backend reads, checked before any unit exists.

The node hands `QemuVmm.unit_for` a plain mapping (it is also what the launch record
keeps); this module turns it into a typed `Launch` and refuses bad input with a message
naming the key.  Keys (docs/vm.md, "Launch description")::

    instance_id     str, required    names the unit (kibotos-vmm-<id>.service)
    unit_name       str              overrides that name
    runtime_dir     abs path, req.   agent.sock, agent-dp.sock, qmp.sock, console.log,
                                     vmm.log go here
    platform_dir    abs path, req.   a Platform: vmlinux, initramfs, platform.json
    template_image  abs path, req.   the Template image, attached read-only
    writable_layer  abs path, req.   the writable layer (ext4), read-write
    volumes         list             [{"path": abs path, "serial"?: str, "read_only"?: bool}]
    vcpus           int 1..64        default 1
    memory          int bytes or "512M"   default 256 MiB; at least 64 MiB
    kernel_args     list of str      appended to the kernel command line
    network         object           the guest's NIC: {"netns_path": abs path (the
                                     namespace the unit joins), "tap": the persistent
                                     tap in it, opened by name, "mac": the guest's MAC}

Disks are found in the guest by virtio serial, never by order: the Template is
``kibotos-root``, the writable layer ``kibotos-rw``, each Volume its ``serial``
(default ``kibotos-vol<index>``; at most 20 bytes, the virtio-blk limit).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kibotos.sdk import Below, InvalidArgument, vmm_launch

ROOT_SERIAL = "kibotos-root"
RW_SERIAL = "kibotos-rw"
AGENT_PORT = "org.kibotos.agent.0"
#: The data plane's own port: a virtio port takes one host at a time, and a new host
#: starts a new guest session, so the node and the data plane each need one.
DATAPLANE_PORT = "org.kibotos.agent.1"
MAX_VCPUS = 64

_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SERIAL = re.compile(r"[A-Za-z0-9._-]{1,20}")
_KNOWN = {"instance_id", "unit_name", "runtime_dir", "platform_dir", "template_image",
          "writable_layer", "volumes", "vcpus", "memory", "kernel_args", "network"}


@dataclass(frozen=True)
class Volume:
    path: Path
    serial: str
    read_only: bool = False


@dataclass(frozen=True)
class Launch(vmm_launch.BaseLaunch[Volume]):
    """The checked description, and where the unit's sockets and logs are."""

    network: vmm_launch.LaunchNetwork | None = None

    agent_socket = Below("runtime_dir", "agent.sock")
    #: The data plane's agent socket (docs/dataplane.md).
    dataplane_socket = Below("runtime_dir", "agent-dp.sock")
    qmp_socket = Below("runtime_dir", "qmp.sock")
    console_log = Below("runtime_dir", "console.log")


def _volumes(launch: Mapping[str, Any]) -> tuple[Volume, ...]:
    out: list[Volume] = []
    seen = {ROOT_SERIAL, RW_SERIAL}
    for i, item in vmm_launch.objects(launch, "volumes"):
        vmm_launch.item_keys(item, {"path", "serial", "read_only"}, f"volumes[{i}]")
        path = vmm_launch.abs_path(item, "path", must_exist="file", label=f"volumes[{i}].path")
        serial = item.get("serial", f"kibotos-vol{i}")
        if not isinstance(serial, str) or not _SERIAL.fullmatch(serial):
            raise InvalidArgument(
                f"launch: volumes[{i}].serial {serial!r} must be 1-20 letters, digits, "
                "'.', '_' or '-'")
        if serial in seen:
            raise InvalidArgument(f"launch: volumes[{i}].serial {serial!r} is used twice "
                                  "or is reserved")
        seen.add(serial)
        read_only = vmm_launch.read_only(item, i)
        out.append(Volume(path, serial, read_only))
    return tuple(out)


def parse_launch(launch: Mapping[str, Any]) -> Launch:
    """Check every key of `launch`; the files it names must exist (a missing image is
    clearer here than as a QEMU error in vmm.log after the unit started)."""
    vmm_launch.check_keys(launch, _KNOWN)
    instance_id = launch.get("instance_id")
    if not isinstance(instance_id, str) or not _TOKEN.fullmatch(instance_id):
        raise InvalidArgument(f"launch: instance_id {instance_id!r} must be 1-64 letters, "
                              "digits, '.', '_' or '-'")
    return Launch(**vmm_launch.base_fields(launch, instance_id, MAX_VCPUS,
                                           lambda: _volumes(launch)),
                  network=vmm_launch.network(launch))
