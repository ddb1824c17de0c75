"""The SDK's part for VMM backends that reach the guest agent (imports trio).

`connect_unix_with_retry` for an agent behind a unix socket (virtio-serial), the vsock
handshake for one behind Firecracker's vsock socket (`connect_vsock`), `wait_hello`
for readiness (the hello, or the first fatal line of the console log), and
`open_guest_channel` to speak the agent's protocol (docs/guest-protocol.md).
`AGENT_PATH` is the agent's launcher, for a backend whose "guest" runs on the host.
"""

from __future__ import annotations

from kibotos.guest import (
    AGENT_PATH,
    GuestChannel,
    GuestInfo,
    connect_unix_with_retry,
    open_guest_channel,
)
from kibotos.guest.vsock import HandshakeRefused, connect_vsock, handshake
from kibotos.vmm_ready import first_kibotos_error, log_tail, wait_hello

__all__ = [
    "AGENT_PATH",
    "GuestChannel",
    "GuestInfo",
    "HandshakeRefused",
    "connect_unix_with_retry",
    "connect_vsock",
    "first_kibotos_error",
    "handshake",
    "log_tail",
    "open_guest_channel",
    "wait_hello",
]
