"""Host-initiated vsock connections through Firecracker's unix socket: the handshake
lives in `kibotos.guest.vsock`, where the data plane uses it too."""

from kibotos.guest.vsock import HandshakeRefused, connect_vsock, handshake

__all__ = ["HandshakeRefused", "connect_vsock", "handshake"]
