"""The operator CLI's HTTP/1.1 connection to ctrl, on the standard library.

``kibo`` used httpx, whose import (with httpcore, which imports trio, anyio and h2 when
they are installed, as they are here) cost about 0.25 s of every command.  A CLI
command sends a handful of requests to one address, so `http.client` with one
keep-alive connection does the whole job in a few milliseconds of import.  What httpx
did for kibo, this module keeps:

* **certificate verification** as httpx does it: a default TLS context (hostname
  checked, certificate required) trusting ``$SSL_CERT_FILE``, else ``$SSL_CERT_DIR``,
  else certifi's bundle;
* **proxies from the environment** (``http_proxy``, ``https_proxy``, ``all_proxy``,
  ``no_proxy``, either case) with httpx's ``no_proxy`` rules: ``*`` disables proxies,
  ``example.com`` matches it and its subdomains, ``.example.com`` only the subdomains,
  an address or ``localhost`` only itself.  ``https://`` targets go through a
  ``CONNECT`` tunnel, ``http://`` ones as absolute-form requests; the proxy itself must
  be ``http://`` (httpx's others needed packages kibo never had);
* a kept-alive connection that the server closed meanwhile is not used for the next
  request (httpx's pool checks the same), so an idle close costs no retry.

Errors stay foreign here (`OSError`, `http.client.HTTPException`, `TimeoutError`):
`kibotos.cli.client` is the one place that translates them.
"""

from __future__ import annotations

import base64
import http.client
import os
import select
import socket
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kibotos.errors import InvalidArgument

if TYPE_CHECKING:
    import ssl


class ConnectError(OSError):
    """The connection (TCP, the proxy's tunnel, or the TLS handshake) could not be
    made; its text is the underlying error's."""


@dataclass(frozen=True)
class Target:
    """Where requests go: scheme, host, port and the base URL's path prefix."""

    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, base_url: str) -> Target:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgument(f"ctrl URL {base_url!r} must be http://HOST[:PORT] or "
                                  "https://HOST[:PORT]")
        try:
            port = parts.port
        except ValueError:
            raise InvalidArgument(f"ctrl URL {base_url!r} has an invalid port") from None
        default = 443 if parts.scheme == "https" else 80
        return cls(parts.scheme, parts.hostname, port or default, parts.path.rstrip("/"))

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


@dataclass(frozen=True)
class Proxy:
    host: str
    port: int
    authorization: str | None  # the Proxy-Authorization value, from the URL's userinfo


def tls_context() -> ssl.SSLContext:
    """The verifying client context httpx would make, trusting the same roots."""
    import ssl

    if os.environ.get("SSL_CERT_FILE"):
        return ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    if os.environ.get("SSL_CERT_DIR"):
        return ssl.create_default_context(capath=os.environ["SSL_CERT_DIR"])
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


def _no_proxy_matches(entry: str, target: Target) -> bool:
    host = target.host.lower()
    if "://" in entry:  # a whole URL pattern: scheme (or all), host, optional port
        parts = urllib.parse.urlsplit(entry)
        if parts.scheme not in ("all", target.scheme):
            return False
        if parts.port is not None and parts.port != target.port:
            return False
        entry = parts.hostname or ""
        if not entry:
            return True
    entry = entry.lower().strip("[]")
    if entry.startswith("."):
        return host.endswith(entry)
    if _is_address(entry) or entry == "localhost":
        return host == entry
    return host == entry or host.endswith("." + entry)


def _is_address(text: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(text.split("/")[0])
    except ValueError:
        return False
    return True


def proxy_for(target: Target) -> Proxy | None:
    """The proxy the environment names for `target`, or None to connect directly."""
    if not any(name.lower().endswith("_proxy") for name in os.environ):
        return None  # the usual case, without importing urllib.request (10 ms)
    import urllib.request

    found = urllib.request.getproxies_environment()
    entries = [e.strip() for e in found.get("no", "").split(",")]
    if "*" in entries or any(e and _no_proxy_matches(e, target) for e in entries):
        return None
    url = found.get(target.scheme) or found.get("all")
    if not url:
        return None
    if "://" not in url:
        url = f"http://{url}"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise InvalidArgument(f"proxy {url!r} from the environment: kibo speaks to "
                              "http:// proxies only")
    authorization = None
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        authorization = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    return Proxy(parts.hostname, parts.port or 80, authorization)


class Connection:
    """One kept-alive connection to `target` (through its proxy, if any), opened on
    first use and again after it broke."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.proxy = proxy_for(target)
        self._conn: http.client.HTTPConnection | None = None
        self._tls: ssl.SSLContext | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(self, method: str, path: str, *, body: bytes | Iterable[bytes] | None,
                headers: Mapping[str, str], timeout: float) -> tuple[
                    http.client.HTTPResponse, bytes]:
        """Send one request and read the whole answer; any failure closes the
        connection (the next request opens a new one) and propagates."""
        conn = self._connection(timeout)
        target = path
        if self.proxy is not None and self.target.scheme == "http":
            target = f"http://{self.target.netloc}{path}"  # absolute form for the proxy
        sent = dict(headers)
        if self.proxy is not None and self.proxy.authorization and \
                self.target.scheme == "http":
            sent["Proxy-Authorization"] = self.proxy.authorization
        try:
            conn.request(method, target, body=body, headers=sent)
            response = conn.getresponse()
            data = response.read()
        except BaseException:
            self.close()
            raise
        if response.will_close:
            self.close()
        return response, data

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        conn = self._conn
        if conn is not None and (conn.sock is None or _readable(conn.sock)):
            # The server closed it while idle (or sent something unasked): start afresh.
            self.close()
            conn = None
        if conn is None:
            conn = self._open(timeout)
            try:
                conn.connect()
            except TimeoutError:
                conn.close()
                raise
            except OSError as exc:
                conn.close()
                raise ConnectError(str(exc) or type(exc).__name__) from exc
            self._conn = conn
        else:
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
        return conn

    def _open(self, timeout: float) -> http.client.HTTPConnection:
        t, proxy = self.target, self.proxy
        host, port = (t.host, t.port) if proxy is None else (proxy.host, proxy.port)
        if t.scheme == "http":
            return http.client.HTTPConnection(host, port, timeout=timeout)
        if self._tls is None:
            self._tls = tls_context()
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=self._tls)
        if proxy is not None:
            tunnel_headers = ({"Proxy-Authorization": proxy.authorization}
                              if proxy.authorization else None)
            conn.set_tunnel(t.host, t.port, headers=tunnel_headers)
        return conn


def _readable(sock: socket.socket) -> bool:
    """Whether an idle kept-alive socket has something to read: the server's close
    (or bytes nobody asked for), so it must not carry the next request."""
    try:
        ready, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):  # closed under us
        return True
    return bool(ready)
