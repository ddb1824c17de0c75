"""Checks of the launch description that every VMM backend shares (public plugin API).

The node hands each VMM backend the same mapping (docs/vm.md, "Launch description");
the keys that mean the same thing under every backend (paths, ``unit_name``, the
Platform's files, ``memory``, ``kernel_args``, bounded integers) are checked here, so
a bad value gets the same message whichever backend reads it.  What differs between
backends (the instance ID's alphabet, Volume serials, taps) stays in the backend.
Every error is `InvalidArgument` naming the key, prefixed ``launch:``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from kibotos.core.errors import InvalidArgument
from kibotos.core.units import parse_size

#: The least memory a guest gets; the default is four times this (256 MiB).
MIN_MEMORY = 64 << 20

_UNIT = re.compile(r"[A-Za-z0-9_.@:-]{1,200}")

#: A backend's own Volume type (with a serial under QEMU, without under Firecracker).
V = TypeVar("V")


@dataclass(frozen=True)
class BaseLaunch(Generic[V]):
    """The fields of a checked launch description that every backend has; a backend's
    ``Launch`` subclasses it, with its own Volume type and what only it reads."""

    instance_id: str
    unit_name: str
    runtime_dir: Path
    vmlinux: Path
    initramfs: Path
    template_image: Path
    writable_layer: Path
    volumes: tuple[V, ...]
    kernel_args: tuple[str, ...]
    vcpus: int
    memory_bytes: int

    @property
    def vmm_log(self) -> Path:
        """The unit's stdout and stderr."""
        return self.runtime_dir / "vmm.log"


def base_fields(launch: Mapping[str, Any], instance_id: str, max_vcpus: int,
                volumes: Callable[[], tuple[V, ...]]) -> dict[str, Any]:
    """The `BaseLaunch` fields of `launch`, checked in one order under every backend:
    `instance_id` is the backend's own check, `volumes` its own Volume parser (called
    in its place), `max_vcpus` its limit.  A backend adds its fields and builds its
    ``Launch(**base_fields(...), ...)``."""
    unit = unit_name(launch, instance_id)
    vmlinux, initramfs = platform_files(launch)
    memory = memory_bytes(launch)
    args = kernel_args(launch)
    return {
        "instance_id": instance_id,
        "unit_name": unit,
        "runtime_dir": abs_path(launch, "runtime_dir", must_exist="dir"),
        "vmlinux": vmlinux,
        "initramfs": initramfs,
        "template_image": abs_path(launch, "template_image", must_exist="file"),
        "writable_layer": abs_path(launch, "writable_layer", must_exist="file"),
        "volumes": volumes(),
        "vcpus": int_in_range(launch, "vcpus", 1, 1, max_vcpus),
        "memory_bytes": memory,
        "kernel_args": args,
    }


def check_keys(launch: Mapping[str, Any], known: Set[str]) -> None:
    """Refuse a `launch` that is not a mapping or has keys outside `known` (a typo
    must not be ignored)."""
    if not isinstance(launch, Mapping):
        raise InvalidArgument("launch description must be an object")
    unknown = set(launch) - known
    if unknown:
        raise InvalidArgument(f"launch: unknown keys {sorted(unknown)}")


def objects(launch: Mapping[str, Any], key: str) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """The items of the list `launch[key]` (``volumes``, ``taps``) with their index,
    each checked to be an object as it is reached (absent: none)."""
    raw = launch.get(key)
    if raw is None:
        return
    if not isinstance(raw, list | tuple):
        raise InvalidArgument(f"launch: {key} must be a list")
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise InvalidArgument(f"launch: {key}[{i}] must be an object")
        yield i, item


def item_keys(item: Mapping[str, Any], known: Set[str], label: str) -> None:
    """Refuse keys of a list item (`label`, e.g. ``volumes[0]``) outside `known`."""
    unknown = set(item) - known
    if unknown:
        raise InvalidArgument(f"launch: {label} has unknown keys {sorted(unknown)}")


def abs_path(launch: Mapping[str, Any], key: str, *,
             must_exist: Literal["file", "dir", "any"] | None = None,
             label: str | None = None) -> Path:
    """`launch[key]` as an absolute path that, per `must_exist`, is a file, a directory
    or anything at all; `label` names the key in errors (for nested items)."""
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
    if must_exist == "any" and not path.exists():
        raise InvalidArgument(f"launch: {key} {path} does not exist")
    return path


def int_in_range(launch: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    """`launch[key]` (or `default`) as an integer from `lo` to `hi`; a bool is refused."""
    value = launch.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgument(f"launch: {key} must be an integer from {lo} to {hi}, "
                              f"not {value!r}")
    return value


def unit_name(launch: Mapping[str, Any], instance_id: str) -> str:
    """``unit_name``, by default ``kibotos-vmm-<instance_id>.service``."""
    name = launch.get("unit_name", f"kibotos-vmm-{instance_id}.service")
    if not isinstance(name, str) or not _UNIT.fullmatch(name) or name.startswith("."):
        raise InvalidArgument(f"launch: unit_name {name!r} is not a valid unit name")
    return name


def platform_files(launch: Mapping[str, Any]) -> tuple[Path, Path]:
    """The Platform's ``vmlinux`` and ``initramfs`` under ``platform_dir``; both must be
    there (a missing one is clearer here than in the VMM's log after the unit started)."""
    platform = abs_path(launch, "platform_dir", must_exist="dir")
    for name in ("vmlinux", "initramfs"):
        if not (platform / name).is_file():
            raise InvalidArgument(f"launch: platform_dir {platform} has no {name}")
    return platform / "vmlinux", platform / "initramfs"


def memory_bytes(launch: Mapping[str, Any]) -> int:
    """``memory`` (a byte count or a size like ``"512M"``; default 256 MiB) in bytes: at
    least `MIN_MEMORY` and a whole number of MiB."""
    memory = launch.get("memory", MIN_MEMORY * 4)
    if isinstance(memory, bool) or not isinstance(memory, int | str):
        raise InvalidArgument(f"launch: memory must be a byte count or a size, not {memory!r}")
    size = parse_size(memory, "launch: memory")
    if size < MIN_MEMORY or size % (1 << 20):
        raise InvalidArgument(f"launch: memory {memory!r} must be at least 64 MiB and a "
                              "whole number of MiB")
    return size


def kernel_args(launch: Mapping[str, Any]) -> tuple[str, ...]:
    """``kernel_args``: words without spaces, appended to the kernel command line."""
    args = launch.get("kernel_args", [])
    if not isinstance(args, list | tuple) or not all(
            isinstance(a, str) and a and not any(c.isspace() for c in a) for a in args):
        raise InvalidArgument("launch: kernel_args must be a list of words without spaces")
    return tuple(args)


def read_only(item: Mapping[str, Any], index: int) -> bool:
    """A Volume's ``read_only`` flag (default false) at ``volumes[index]``."""
    value = item.get("read_only", False)
    if not isinstance(value, bool):
        raise InvalidArgument(f"launch: volumes[{index}].read_only must be true or false")
    return value


_IFNAME = re.compile(r"[A-Za-z0-9_.-]{1,15}")
_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")


@dataclass(frozen=True)
class LaunchNetwork:
    """``network`` of a launch: the guest's NIC (docs/vm.md, "Launch description").

    The node made the namespace and, in it, the persistent tap `tap` (owned by the
    account the VMM runs as, so the VMM opens it by name without any capability); the
    VMM unit joins the namespace (``NetworkNamespacePath``) and gives the guest a
    virtio-net device with `mac` on the tap."""

    netns_path: Path
    tap: str
    mac: str


def network(launch: Mapping[str, Any]) -> LaunchNetwork | None:
    """``network`` (absent or null: no NIC) as `LaunchNetwork`: ``netns_path`` an
    absolute path, ``tap`` an interface name, ``mac`` a unicast MAC in lower case.

    The namespace's existence is not checked: the recorded launch is parsed again for
    as long as the VMM runs (its guest channel, its Volumes), also after someone
    removed the namespace's name while the VMM keeps the namespace; starting a unit in
    a namespace that is not there fails at the start, naming it."""
    value = launch.get("network")
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidArgument("launch: network must be an object")
    item_keys(value, {"netns_path", "tap", "mac"}, "network")
    path = abs_path(value, "netns_path", label="network.netns_path")
    tap, mac = value.get("tap"), value.get("mac")
    if not isinstance(tap, str) or not _IFNAME.fullmatch(tap):
        raise InvalidArgument(f"launch: network.tap {tap!r} must be an interface name "
                              "(1-15 letters, digits, '_', '.', '-')")
    if not isinstance(mac, str) or not _MAC.fullmatch(mac) or int(mac[:2], 16) & 1:
        raise InvalidArgument(f"launch: network.mac {mac!r} must be a unicast MAC like "
                              "02:00:00:00:00:01 (lower case)")
    return LaunchNetwork(path, tap, mac)
