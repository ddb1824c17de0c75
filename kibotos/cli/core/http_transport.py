"""The operator CLI's HTTP/1.1 connection to ctrl: a socket and h11.

``kibo`` used httpx, whose import (with httpcore, which imports trio, anyio and h2 when
they are installed, as they are here) cost about 0.25 s of every command.  A CLI
command sends a handful of requests to one address, so one kept-alive socket with h11
(the sans-I/O HTTP/1.1 state machine under httpcore itself, which ``kibo workspace
exec``'s WebSocket upgrade uses too) does the whole job; `http.client` would cost
twice h11's import (its email parser, and ssl even for ``http://``).  What httpx did
for kibo, this module keeps:

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

Errors stay low-level here: `TimeoutError`, `ConnectError` (the connection could not
be made), other `OSError` (including `ProtocolError`); `kibotos.cli.core.client` is the one
place that translates them.
"""

from __future__ import annotations

import base64
import os
import select
import socket
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import h11

from kibotos.core.errors import InvalidArgument

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


@dataclass(frozen=True)
class Answer:
    """What the server answered: status line and the whole body."""

    status: int
    reason: str
    content: bytes


class ProtocolError(OSError):
    """The answer broke HTTP/1.1, or the connection ended in the middle of it (a
    transport failure to the caller, like a reset)."""


class Connection:
    """One kept-alive connection to `target` (through its proxy, if any), opened on
    first use and again after it broke.  HTTP/1.1 is h11's (the sans-I/O parser the
    data plane already uses), on a plain or TLS socket."""

    def __init__(self, target: Target, *, tls: ssl.SSLContext | None = None) -> None:
        """`tls` verifies an ``https://`` target (a context of the pinned CA); None:
        `tls_context`'s, made on the first TLS connection."""
        self.target = target
        self.proxy = proxy_for(target)
        self._sock: socket.socket | None = None
        self._http: h11.Connection | None = None
        self._tls: ssl.SSLContext | None = tls

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = self._http = None

    def request(self, method: str, path: str, *, body: bytes | Iterable[bytes] | None,
                headers: Mapping[str, str], timeout: float) -> Answer:
        """Send one request and read the whole answer; any failure closes the
        connection (the next request opens a new one) and propagates."""
        target = path
        sent = {"Host": self.target.netloc, **headers}
        if self.proxy is not None and self.target.scheme == "http":
            target = f"http://{self.target.netloc}{path}"  # absolute form for the proxy
            if self.proxy.authorization:
                sent["Proxy-Authorization"] = self.proxy.authorization
        if isinstance(body, bytes):
            sent["Content-Length"] = str(len(body))
        elif body is None and method in ("POST", "PUT", "PATCH"):
            sent["Content-Length"] = "0"
        sock, conn = self._connection(timeout)
        try:
            sock.sendall(conn.send(h11.Request(method=method, target=target,
                                               headers=list(sent.items()))))
            for chunk in [body] if isinstance(body, bytes) else body or ():
                if chunk:
                    sock.sendall(conn.send(h11.Data(data=chunk)))
            sock.sendall(conn.send(h11.EndOfMessage()))
            answer = _read_answer(sock, conn)
        except h11.ProtocolError as exc:
            self.close()
            raise ProtocolError(str(exc) or type(exc).__name__) from None
        except BaseException:
            self.close()
            raise
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:
            self.close()
        return answer

    def _connection(self, timeout: float) -> tuple[socket.socket, h11.Connection]:
        if self._sock is not None and _readable(self._sock):
            # The server closed it while idle (or sent something unasked): start afresh.
            self.close()
        if self._sock is None or self._http is None:
            self._sock = self._open(timeout)
            self._http = h11.Connection(h11.CLIENT)
        self._sock.settimeout(timeout)
        return self._sock, self._http

    def _open(self, timeout: float) -> socket.socket:
        """A connected socket (tunnelled and with TLS as the target needs)."""
        t, proxy = self.target, self.proxy
        host, port = (t.host, t.port) if proxy is None else (proxy.host, proxy.port)
        sock: socket.socket | None = None
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if t.scheme == "https":
                if proxy is not None:
                    _tunnel(sock, t, proxy)
                if self._tls is None:
                    self._tls = tls_context()
                sock = self._tls.wrap_socket(sock, server_hostname=t.host)
            return sock
        except TimeoutError:
            if sock is not None:
                sock.close()
            raise
        except (OSError, h11.ProtocolError) as exc:
            if sock is not None:
                sock.close()
            raise ConnectError(str(exc) or type(exc).__name__) from exc


def _read_answer(sock: socket.socket, conn: h11.Connection) -> Answer:
    response: h11.Response | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(1 << 16))
        elif isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert response is not None
            return Answer(response.status_code, response.reason.decode("latin-1"),
                          bytes(body))
        elif isinstance(event, h11.ConnectionClosed):
            raise ProtocolError("the server closed the connection without an answer")
        # InformationalResponse (1xx) and the like: wait for the final answer.


def _tunnel(sock: socket.socket, target: Target, proxy: Proxy) -> None:
    """``CONNECT host:port`` through the proxy on `sock`; afterwards the socket is the
    tunnel (TLS to the target goes inside it)."""
    authority = f"[{target.host}]:{target.port}" if ":" in target.host else \
        f"{target.host}:{target.port}"
    headers = [("Host", authority)]
    if proxy.authorization:
        headers.append(("Proxy-Authorization", proxy.authorization))
    conn = h11.Connection(h11.CLIENT)
    sock.sendall(conn.send(h11.Request(method="CONNECT", target=authority,
                                       headers=headers)))
    sock.sendall(conn.send(h11.EndOfMessage()))
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(1 << 16))
        elif isinstance(event, h11.Response):
            if not 200 <= event.status_code < 300:
                raise OSError(f"the proxy refused the tunnel: {event.status_code} "
                              f"{event.reason.decode('latin-1')}")
            return
        elif isinstance(event, h11.ConnectionClosed):
            raise OSError("the proxy closed the connection instead of a tunnel")
def _readable(sock: socket.socket) -> bool:
    """Whether an idle kept-alive socket has something to read: the server's close
    (or bytes nobody asked for), so it must not carry the next request."""
    try:
        ready, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):  # closed under us
        return True
    return bool(ready)
