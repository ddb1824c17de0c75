"""TLS on the data-plane listener, with the certificate the node supplies.

The data plane never reads the node's state directory (spec: node-and-vmm-processes,
"Data-plane processes"), so the node sends the certificate and its key as PEM in a
control request (``{"type": "certificate", "certificate", "key"}``, `DataplaneTls.load`).
They go into the one `ssl.SSLContext` the listener serves with: OpenSSL copies a
context's certificate into each connection when it is accepted, so a new certificate
reaches new handshakes only and established connections keep theirs.  A renewal needs
no restart and drops nothing.

Until the first certificate arrives every handshake fails (the context has none to
offer), and a certificate that expired while the node was away stays in use until the
node sends a new one, so new clients refuse it while established connections go on:
the spec's behaviour for a node that is stopped past the certificate's end.

Plain HTTP carries session credentials in clear text, so it is an explicit choice and
only on a loopback address (`check_plain`, the rule ctrl's listener follows too).
"""

from __future__ import annotations

import datetime as dt
import os
import ssl
import tempfile
from pathlib import Path
from typing import Any

import trio
from cryptography import x509

from kibotos.core.errors import InvalidArgument
from kibotos.tls.contexts import is_loopback
from kibotos.tls.server import server_context

#: A PEM certificate chain or key the node sends; far above a P-256 leaf (~800 bytes).
MAX_PEM = 64 * 1024


def check_plain(host: str) -> None:
    """`InvalidArgument` unless `host` is a loopback address: plain serving elsewhere
    would put session credentials on the wire in clear text."""
    if not is_loopback(host):
        raise InvalidArgument(f"the data plane serves plain HTTP only on a loopback address, "
                              f"not {host!r}: serve TLS (the node's dataplane_tls = true)")


def _pem_field(message: dict[str, Any], name: str) -> str:
    value = message.get(name)
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"certificate request field {name!r} must be PEM text")
    if len(value) > MAX_PEM:
        raise InvalidArgument(f"certificate request field {name!r} is longer than "
                              f"{MAX_PEM} characters")
    return value


class DataplaneTls:
    """The listener's server context and what it was last given."""

    def __init__(self, scratch_dir: Path) -> None:
        #: Where the PEM is written for the moment of loading (OpenSSL loads files
        #: only): the data plane's own 0700 directory under the socket directory.
        self.scratch_dir = scratch_dir
        self.context = server_context()
        self.serial: int | None = None
        self.not_after: dt.datetime | None = None

    def wrap(self, listeners: list[trio.SocketListener]
             ) -> list[trio.SSLListener[trio.SocketStream]]:
        return [trio.SSLListener(listener, self.context, https_compatible=True)
                for listener in listeners]

    def load(self, message: dict[str, Any]) -> dict[str, Any]:
        """Take the certificate of a control request for new handshakes; a pair that
        does not load is refused naming why, and the one in use stays."""
        cert_pem = _pem_field(message, "certificate")
        key_pem = _pem_field(message, "key")
        try:
            leaf = x509.load_pem_x509_certificate(cert_pem.encode())
        except ValueError as exc:
            raise InvalidArgument(f"certificate is not a PEM certificate: {exc}") from None
        # Loaded into a scratch context first: a key that is not the certificate's must
        # not leave the live context half replaced.
        self._load_into(server_context(), cert_pem, key_pem)
        self._load_into(self.context, cert_pem, key_pem)
        self.serial, self.not_after = leaf.serial_number, leaf.not_valid_after_utc
        return self.status()

    def _load_into(self, context: ssl.SSLContext, cert_pem: str, key_pem: str) -> None:
        self.scratch_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".tls-", suffix=".pem", dir=self.scratch_dir)
        try:
            with os.fdopen(fd, "w", encoding="ascii") as scratch:  # 0600 from mkstemp
                scratch.write(cert_pem.rstrip("\n") + "\n" + key_pem)
            context.load_cert_chain(name)
        except (ssl.SSLError, UnicodeEncodeError) as exc:
            raise InvalidArgument(f"the certificate and key do not load together: "
                                  f"{exc}") from None
        finally:
            os.unlink(name)

    def status(self) -> dict[str, Any]:
        """What ``status`` reports, so the node sees whether its certificate is in use."""
        return {"tls": True,
                "certificate_serial": None if self.serial is None else f"{self.serial:x}",
                "certificate_not_after": None if self.not_after is None
                else self.not_after.isoformat()}


PLAIN_STATUS: dict[str, Any] = {"tls": False, "certificate_serial": None,
                                "certificate_not_after": None}
