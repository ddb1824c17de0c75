"""Which device the guest mounts each Volume of an Instance from, and where.

``instance.create`` lists Volumes with an optional ``mount_point`` (default
``/mnt/<volume_id>``); the launch description gives them to the VMM in the same order,
and the backend's ``volume_devices(launch)`` says under which guest path each appears
(``/dev/disk/by-id/virtio-<serial>``: QEMU sets the serial, Firecracker derives it from
the file).  The guest agent's ``configure`` then mounts them (``kibotos_guest.configure``)
and stop_prepare syncs and freezes them with the writable layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kibotos.backends import VmmBackend
from kibotos.core.errors import FailedPrecondition
from kibotos.guest import Volume
from kibotos.protocol import CreateSpec


def guest_volumes(backend: VmmBackend, launch: Mapping[str, Any] | None, spec: CreateSpec
                  ) -> list[Volume] | None:
    """The ``volumes`` of the guest's configure; None (leave the guest's as they are)
    when the Instance has none, or when the backend cannot name its guest devices
    (`VmmBackend.volume_devices` says None: a test backend whose "guest" has no block
    devices)."""
    if not spec.volumes or launch is None:
        return None
    named = backend.volume_devices(launch)
    if named is None:
        return None
    devices = list(named)
    if len(devices) != len(spec.volumes):
        raise FailedPrecondition(f"the launch has {len(devices)} Volume devices for "
                                 f"{len(spec.volumes)} Volumes")
    return [Volume(device=str(dev), mount_point=vol.mount())
            for dev, vol in zip(devices, spec.volumes, strict=True)]
