"""A server's certificate in one SSL context that can take a new certificate while the
server runs.

A TLS listener reads its context's certificate at every handshake, so loading a new
chain into the same `ssl.SSLContext` (`ServerCertificate.load`) changes what *new*
connections get and leaves established ones alone: a renewal needs no restart and
drops nothing.
"""

from __future__ import annotations

import datetime as dt
import ssl
from pathlib import Path

from cryptography import x509

from kibotos.core import atomicfile
from kibotos.core.errors import InvalidArgument

#: What the servers speak: the API and the data plane are HTTP/1.1 and WebSocket.
ALPN = ["http/1.1"]


def server_context() -> ssl.SSLContext:
    """A server context without a certificate yet: TLS 1.2 at least, no client
    certificates (callers authenticate with bearer credentials)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_COMPRESSION
    context.set_alpn_protocols(ALPN)
    return context


def not_after(cert_pem: bytes, source: str) -> dt.datetime:
    """The end of validity of the first certificate in `cert_pem` (UTC)."""
    try:
        return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc
    except ValueError as exc:
        raise InvalidArgument(f"{source} is not a PEM certificate: {exc}") from None


def due(cert_pem: bytes, *, now: dt.datetime, lifetime: dt.timedelta,
        fraction: float = 1 / 3) -> bool:
    """Whether a certificate issued for `lifetime` should be renewed at `now`: when
    less than `fraction` of that lifetime is left (well before it expires)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        return True
    return cert.not_valid_after_utc - now < lifetime * fraction


def write_pair(cert_file: Path, key_file: Path, cert_pem: bytes, key_pem: bytes) -> None:
    """Write a certificate and its key durably (key 0600).  The key goes first: a crash
    between the two leaves the old certificate with a new key, which `ServerCertificate.load`
    refuses, and the caller then issues again."""
    atomicfile.write_bytes(key_file, key_pem, mode=0o600)
    atomicfile.write_bytes(cert_file, cert_pem, mode=0o644)


class ServerCertificate:
    """The context a listener serves with, and the files it loads from."""

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.context = server_context()
        self.not_after: dt.datetime | None = None

    def load(self) -> None:
        """(Re)load the pair from disk into the live context; `InvalidArgument` naming
        the files when they do not load (missing, not PEM, a key that is not the
        certificate's)."""
        try:
            self.context.load_cert_chain(str(self.cert_file), str(self.key_file))
            self.not_after = not_after(self.cert_file.read_bytes(), str(self.cert_file))
        except (OSError, ssl.SSLError) as exc:
            raise InvalidArgument(f"TLS certificate {self.cert_file} with key "
                                  f"{self.key_file} does not load: {exc}") from None
