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
    netns_path      abs path         reserved for the network issue; must be absent now

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

from kibotos.errors import InvalidArgument
from kibotos.units import parse_size

ROOT_SERIAL = "kibotos-root"
RW_SERIAL = "kibotos-rw"
AGENT_PORT = "org.kibotos.agent.0"
#: The data plane's own port: a virtio port takes one host at a time, and a new host
#: starts a new guest session, so the node and the data plane each need one.
DATAPLANE_PORT = "org.kibotos.agent.1"
MIN_MEMORY = 64 << 20
MAX_VCPUS = 64

_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_UNIT = re.compile(r"[A-Za-z0-9_.@:-]{1,200}")
_SERIAL = re.compile(r"[A-Za-z0-9._-]{1,20}")
_KNOWN = {"instance_id", "unit_name", "runtime_dir", "platform_dir", "template_image",
          "writable_layer", "volumes", "vcpus", "memory", "kernel_args", "netns_path"}


@dataclass(frozen=True)
class Volume:
    path: Path
    serial: str
    read_only: bool = False


@dataclass(frozen=True)
class Launch:
    instance_id: str
    unit_name: str
    runtime_dir: Path
    vmlinux: Path
    initramfs: Path
    template_image: Path
    writable_layer: Path
    volumes: tuple[Volume, ...]
    vcpus: int
    memory_bytes: int
    kernel_args: tuple[str, ...]

    @property
    def agent_socket(self) -> Path:
        return self.runtime_dir / "agent.sock"

    @property
    def dataplane_socket(self) -> Path:
        """The data plane's agent socket (docs/dataplane.md)."""
        return self.runtime_dir / "agent-dp.sock"

    @property
    def qmp_socket(self) -> Path:
        return self.runtime_dir / "qmp.sock"

    @property
    def console_log(self) -> Path:
        return self.runtime_dir / "console.log"

    @property
    def vmm_log(self) -> Path:
        return self.runtime_dir / "vmm.log"


def _abs_path(launch: Mapping[str, Any], key: str, *, must_exist: str | None = None,
              label: str | None = None) -> Path:
    value = launch.get(key)
    key = label or key
    if not isinstance(value, str | Path) or not str(value):
        raise InvalidArgument(f"launch: {key} is required and must be a path")
    path = Path(value)
    if not path.is_absolute():
        raise InvalidArgument(f"launch: {key} must be an absolute path, not {str(value)!r}")
    if must_exist == "file" and not path.is_file():
        raise InvalidArgument(f"launch: {key} {path} does not exist or is not a file")
    if must_exist == "dir" and not path.is_dir():
        raise InvalidArgument(f"launch: {key} {path} does not exist or is not a directory")
    return path


def _int(launch: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = launch.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgument(f"launch: {key} must be an integer from {lo} to {hi}, "
                              f"not {value!r}")
    return value


def _volumes(raw: Any) -> tuple[Volume, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple):
        raise InvalidArgument("launch: volumes must be a list")
    out: list[Volume] = []
    seen = {ROOT_SERIAL, RW_SERIAL}
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise InvalidArgument(f"launch: volumes[{i}] must be an object")
        unknown = set(item) - {"path", "serial", "read_only"}
        if unknown:
            raise InvalidArgument(f"launch: volumes[{i}] has unknown keys {sorted(unknown)}")
        path = _abs_path(item, "path", must_exist="file", label=f"volumes[{i}].path")
        serial = item.get("serial", f"kibotos-vol{i}")
        if not isinstance(serial, str) or not _SERIAL.fullmatch(serial):
            raise InvalidArgument(
                f"launch: volumes[{i}].serial {serial!r} must be 1-20 letters, digits, "
                "'.', '_' or '-'")
        if serial in seen:
            raise InvalidArgument(f"launch: volumes[{i}].serial {serial!r} is used twice "
                                  "or is reserved")
        seen.add(serial)
        read_only = item.get("read_only", False)
        if not isinstance(read_only, bool):
            raise InvalidArgument(f"launch: volumes[{i}].read_only must be true or false")
        out.append(Volume(path, serial, read_only))
    return tuple(out)


def parse_launch(launch: Mapping[str, Any]) -> Launch:
    """Check every key of `launch`; the files it names must exist (a missing image is
    clearer here than as a QEMU error in vmm.log after the unit started)."""
    if not isinstance(launch, Mapping):
        raise InvalidArgument("launch description must be an object")
    unknown = set(launch) - _KNOWN
    if unknown:
        raise InvalidArgument(f"launch: unknown keys {sorted(unknown)}")
    if launch.get("netns_path") is not None:
        raise InvalidArgument("launch: netns_path is not supported by this version")
    instance_id = launch.get("instance_id")
    if not isinstance(instance_id, str) or not _TOKEN.fullmatch(instance_id):
        raise InvalidArgument(f"launch: instance_id {instance_id!r} must be 1-64 letters, "
                              "digits, '.', '_' or '-'")
    unit_name = launch.get("unit_name", f"kibotos-vmm-{instance_id}.service")
    if not isinstance(unit_name, str) or not _UNIT.fullmatch(unit_name) or \
            unit_name.startswith("."):
        raise InvalidArgument(f"launch: unit_name {unit_name!r} is not a valid unit name")
    platform = _abs_path(launch, "platform_dir", must_exist="dir")
    for name in ("vmlinux", "initramfs"):
        if not (platform / name).is_file():
            raise InvalidArgument(f"launch: platform_dir {platform} has no {name}")
    memory = launch.get("memory", MIN_MEMORY * 4)
    if isinstance(memory, bool) or not isinstance(memory, int | str):
        raise InvalidArgument(f"launch: memory must be a byte count or a size, not {memory!r}")
    memory_bytes = parse_size(memory, "launch: memory")
    if memory_bytes < MIN_MEMORY or memory_bytes % (1 << 20):
        raise InvalidArgument(f"launch: memory {memory!r} must be at least 64 MiB and a "
                              "whole number of MiB")
    args = launch.get("kernel_args", [])
    if not isinstance(args, list | tuple) or not all(
            isinstance(a, str) and a and not any(c.isspace() for c in a) for a in args):
        raise InvalidArgument("launch: kernel_args must be a list of words without spaces")
    return Launch(
        instance_id=instance_id,
        unit_name=unit_name,
        runtime_dir=_abs_path(launch, "runtime_dir", must_exist="dir"),
        vmlinux=platform / "vmlinux",
        initramfs=platform / "initramfs",
        template_image=_abs_path(launch, "template_image", must_exist="file"),
        writable_layer=_abs_path(launch, "writable_layer", must_exist="file"),
        volumes=_volumes(launch.get("volumes")),
        vcpus=_int(launch, "vcpus", 1, 1, MAX_VCPUS),
        memory_bytes=memory_bytes,
        kernel_args=tuple(args),
    )
