"""A forward HTTP proxy on loopback for the CLI's transport tests, and a TLS certificate.

The proxy takes ``CONNECT host:port`` (then pipes bytes both ways: the tunnel an
``https://`` ctrl URL goes through) and absolute-form requests ``GET http://host:port/…``
(rewritten to origin form and piped to that host), and records each request line and
its ``Proxy-Authorization``.  It serves only loopback targets, on daemon threads, and
stops with its context.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import socketserver
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


class _Handler(socketserver.StreamRequestHandler):
    server: _ProxyServer

    def handle(self) -> None:
        line = self.rfile.readline(65536).decode("latin-1")
        headers = []
        while (header := self.rfile.readline(65536)) not in (b"\r\n", b"\n", b""):
            headers.append(header)
        auth = next((h.decode("latin-1").split(":", 1)[1].strip() for h in headers
                     if h.lower().startswith(b"proxy-authorization:")), None)
        method, target, version = line.split()
        self.server.seen.append((line.strip(), auth))
        if method == "CONNECT":
            host, _, port = target.rpartition(":")
            upstream = self._upstream(host, int(port))
            self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            parts = urlsplit(target)
            upstream = self._upstream(parts.hostname or "", parts.port or 80)
            path = parts.path + (f"?{parts.query}" if parts.query else "")
            kept = [h for h in headers if not h.lower().startswith(b"proxy-")]
            upstream.sendall(f"{method} {path} {version}\r\n".encode() + b"".join(kept)
                             + b"\r\n")
        self._pipe(upstream)

    def _upstream(self, host: str, port: int) -> socket.socket:
        assert ipaddress.ip_address(socket.gethostbyname(host)).is_loopback, host
        return socket.create_connection((host, port), timeout=30)

    def _pipe(self, upstream: socket.socket) -> None:
        def down() -> None:
            try:
                while data := upstream.recv(65536):
                    self.connection.sendall(data)
            except OSError:
                pass
            finally:
                self.connection.close()

        thread = threading.Thread(target=down, daemon=True)
        thread.start()
        try:
            while data := self.rfile.read1(65536):  # what the header reads buffered first
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            upstream.close()
            thread.join(timeout=30)


class _ProxyServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[tuple[str, str | None]] = []


class Proxy:
    def __init__(self) -> None:
        self.server = _ProxyServer()
        host, port = self.server.server_address[:2]
        self.url = f"http://{host}:{port}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)

    @property
    def seen(self) -> list[tuple[str, str | None]]:
        return self.server.seen

    def __enter__(self) -> Proxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def self_signed(directory: Path, *, names: tuple[str, ...] = ("localhost",),
                addresses: tuple[str, ...] = ("127.0.0.1",)) -> tuple[Path, Path]:
    """A self-signed certificate for `names` and `addresses`: (cert.pem, key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    now = datetime.datetime.now(datetime.UTC)
    sans = [x509.DNSName(n) for n in names] + [
        x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path
