"""Host-initiated vsock connections through Firecracker's unix socket: the handshake
lives in the SDK (`kibotos.sdk.guest`), where the data plane uses it too."""

from kibotos.sdk.guest import HandshakeRefused, connect_vsock, handshake

__all__ = ["HandshakeRefused", "connect_vsock", "handshake"]
