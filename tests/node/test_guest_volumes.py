"""Which guest device and mount point each Volume of an Instance gets in the guest's
``configure``: the backend's ``volume_devices`` in launch order, the ``mount_point`` of
``instance.create`` or ``/mnt/<volume_id>``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from kibotos_qemu.backend import QemuVmm

from kibotos.backends import VmmBackend
from kibotos.guest import Volume
from kibotos.node.runtime.guest_volumes import guest_volumes
from kibotos.protocol import CreateSpec

DIGEST = "sha256:" + "ab" * 32


def spec(volumes: list[dict]) -> CreateSpec:
    return CreateSpec.model_validate({
        "instance_id": "inst-1", "workspace_id": "ws-1",
        "template": {"name": "tiny", "image_digest": DIGEST, "kernel_digest": DIGEST,
                     "initramfs_digest": DIGEST},
        "cpu_millis": 1000, "memory_bytes": 256 << 20,
        "layer": {"pool_id": "pool-a", "ref": "ws-1", "capacity_bytes": 64 << 20, "epoch": 1},
        "volumes": volumes})


def launch(tmp_path: Path, count: int) -> dict:
    platform = tmp_path / "platform"
    platform.mkdir()
    for name in ("vmlinux", "initramfs"):
        (platform / name).write_bytes(b"x")
    files = []
    for name in ["template.img", "rw.img", *[f"vol{i}.ext4" for i in range(count)]]:
        (tmp_path / name).write_bytes(b"")
        files.append(str(tmp_path / name))
    return {"instance_id": "inst-1", "unit_name": "kibotos-vmm-inst-1.service",
            "runtime_dir": str(tmp_path), "platform_dir": str(platform),
            "template_image": files[0], "writable_layer": files[1],
            "volumes": [{"path": p} for p in files[2:]], "vcpus": 1, "memory": 256 << 20}


def test_each_volume_gets_its_device_and_mount_point(tmp_path: Path) -> None:
    s = spec([{"volume_id": "vol-a", "pool_id": "pool-a", "epoch": 1},
              {"volume_id": "vol-b", "pool_id": "pool-a", "epoch": 2,
               "mount_point": "/srv/data"}])
    got = guest_volumes(QemuVmm({}), launch(tmp_path, 2), s)
    assert got == [Volume("/dev/disk/by-id/virtio-kibotos-vol0", "/mnt/vol-a"),
                   Volume("/dev/disk/by-id/virtio-kibotos-vol1", "/srv/data")]
    assert all(v.retained and not v.read_only and v.fs_type == "ext4" for v in got or [])


def test_no_volumes_leaves_the_guest_alone(tmp_path: Path) -> None:
    assert guest_volumes(QemuVmm({}), launch(tmp_path, 0), spec([])) is None


def test_a_backend_without_devices_mounts_nothing(tmp_path: Path) -> None:
    """The default of `VmmBackend.volume_devices` (None): the backend cannot name them."""

    class NoDevices(QemuVmm):
        def volume_devices(self, launch: Mapping[str, Any]) -> None:
            return VmmBackend.volume_devices(self, launch)

    s = spec([{"volume_id": "vol-a", "pool_id": "pool-a", "epoch": 1}])
    assert guest_volumes(NoDevices({}), launch(tmp_path, 1), s) is None


def test_two_volumes_on_one_mount_point_are_refused() -> None:
    from kibotos.core.errors import InvalidArgument
    from kibotos.protocol import parse_args
    with pytest.raises(InvalidArgument, match="share a mount point"):
        parse_args(CreateSpec, spec([]).model_dump(mode="json") | {
            "volumes": [{"volume_id": "vol-a", "pool_id": "pool-a", "epoch": 1},
                        {"volume_id": "vol-b", "pool_id": "pool-a", "epoch": 1,
                         "mount_point": "/mnt/vol-a"}]})
