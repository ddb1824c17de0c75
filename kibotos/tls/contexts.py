"""SSL contexts from the cluster's certificates, and the rule for plain HTTP.

Clients verify: a context from `client_context` always checks the chain and the host
name, against a pinned CA when one is given (the cluster CA, or the CA of an
operator's certificate) and against the system's trust store otherwise.  Nothing here
can make a context that skips verification.

Plain ``http://`` carries bearer credentials in clear text, so it is allowed only to a
loopback address (`require_secure`): there the bytes never leave the host.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kibotos.core.errors import InvalidArgument

if TYPE_CHECKING:  # both imported on use: `kibo` imports this module for every command
    import ssl


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or address, IPv6 with or without brackets) is this host's
    loopback: ``localhost`` or an address in 127.0.0.0/8 or ::1."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def require_secure(url: str, what: str) -> None:
    """`InvalidArgument` unless `url` is ``https``/``wss``, or plain on loopback."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
        raise InvalidArgument(f"{what} {url!r} is not http(s)://HOST[:PORT]")
    if parts.scheme in ("http", "ws") and not is_loopback(parts.hostname):
        raise InvalidArgument(f"{what} {url} carries credentials: it must be https:// "
                              "(plain http only to a loopback address)")


def check_ca_pem(pem: bytes | str, source: str) -> bytes:
    """`pem` if it holds at least one PEM certificate, else `InvalidArgument` naming
    `source`."""
    from cryptography import x509

    data = pem.encode() if isinstance(pem, str) else pem
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise InvalidArgument(f"{source} is not a PEM certificate: {exc}") from None
    if not certs:
        raise InvalidArgument(f"{source} holds no PEM certificate")
    return data


def read_ca_file(path: Path | str, what: str) -> bytes:
    """The PEM CA certificate(s) in `path`; `InvalidArgument` naming `what` and the file."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {what} {path}: {exc.strerror}") from None
    return check_ca_pem(data, f"{what} {path}")


def client_context(ca_pem: bytes | str | None = None) -> ssl.SSLContext:
    """A verifying client context: trusting `ca_pem` only, or the system store."""
    import ssl

    if ca_pem is None:
        return ssl.create_default_context()
    text = ca_pem.decode() if isinstance(ca_pem, bytes) else ca_pem
    return ssl.create_default_context(cadata=text)


def client_context_from_file(path: Path | str | None, what: str) -> ssl.SSLContext:
    """`client_context` of the CA file at `path` (None: the system store)."""
    return client_context(None if path is None else read_ca_file(path, what))


def verification_error(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification failure under a connection error (httpx and trio
    wrap it), if that is what it is: a retry cannot fix it, the caller says so."""
    import ssl

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
