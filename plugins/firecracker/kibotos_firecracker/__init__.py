"""Built-in VMM backend ``firecracker``: microVMs under Firecracker, through its jailer.

The unit runs the jailer as root; the jailer builds a chroot under the shared sandbox
root, drops to the VMM account and execs Firecracker, which then waits on its API
socket.  The backend configures the microVM over that socket (machine, boot source,
drives, vsock, network interfaces) and starts it; the guest agent is reached over
Firecracker's vsock, by the ``CONNECT <port>`` handshake on a unix socket in the jail.
Registered through the plugin SDK (`kibotos.sdk`) only, like any third-party plugin;
docs/vm.md ("The firecracker VMM backend") describes the whole path.
"""

from __future__ import annotations

from kibotos.sdk import Register, hookimpl

__all__ = ["kibotos_register_vmm"]


@hookimpl
def kibotos_register_vmm(register: Register) -> None:
    from kibotos_firecracker.backend import FirecrackerVmm

    register(FirecrackerVmm)
