"""Built-in VMM backend ``qemu``: microVMs under QEMU's ``microvm`` machine.

Boots a Platform (ELF vmlinux by PVH + the kibotos initramfs) with a Template image
read-only, the writable layer and Volumes as virtio-mmio disks, and the guest agent on a
virtio-serial port behind a unix socket.  KVM where a probe guest really boots, TCG
otherwise (see `kibotos_qemu.probe`).  Registered through the plugin SDK (`kibotos.sdk`)
only, like any third-party plugin; docs/vm.md describes the whole VM path.
"""

from __future__ import annotations

from kibotos.sdk import Register, hookimpl

__all__ = ["kibotos_register_vmm"]


@hookimpl
def kibotos_register_vmm(register: Register) -> None:
    from kibotos_qemu.backend import QemuVmm

    register(QemuVmm)
