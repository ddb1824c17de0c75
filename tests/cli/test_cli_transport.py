"""kibo's HTTP connection to ctrl (`kibotos.cli.core.http_transport`): the rules it kept from
httpx when it stopped using it.

* TLS: a ctrl URL ``https://`` is verified (certificate chain and host name) against
  ``SSL_CERT_FILE``, else ``SSL_CERT_DIR``, else certifi's bundle: a self-signed ctrl
  is refused until the operator names its certificate;
* proxies from the environment: absolute-form requests for ``http://``, a ``CONNECT``
  tunnel for ``https://``, credentials from the proxy URL, and ``no_proxy``;
* a kept-alive connection the server closed while idle is not used again.

The ctrl is the recording fake on loopback (with TLS where needed), the proxy the one of
cli_proxy.py; nothing leaves loopback.
"""

from __future__ import annotations

import base64
import select
import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_fakectrl import FakeCtrl, FakeCtrlServer
from cli_invoke import invoke
from cli_nodes import node
from cli_proxy import Proxy, self_signed

from kibotos.cli.core.client import Client
from kibotos.cli.core.http_transport import Target, proxy_for
from kibotos.core.errors import InvalidArgument, Unavailable

PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "HTTP_PROXY",
              "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "SSL_CERT_FILE", "SSL_CERT_DIR")


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def cert(tmp_path: Path) -> tuple[Path, Path]:
    return self_signed(tmp_path)


@pytest.fixture
def tls_ctrl(cert: tuple[Path, Path]) -> Iterator[FakeCtrl]:
    server = FakeCtrlServer()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*cert)
    server.server.socket = context.wrap_socket(server.server.socket, server_side=True)
    server.fake.url = server.fake.url.replace("http://", "https://")
    with server as fake:
        fake.route("GET", "/v1/nodes/node-a", (200, {"result": node()}))
        yield fake


def config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "kibo.toml"
    path.write_text(f'ctrl_url = "{url}"\ncredential = "kid-x:secret"\ntimeout = 10.0\n')
    return path


def test_https_is_verified_against_the_configured_roots(tmp_path, tls_ctrl, cert,
                                                        monkeypatch):
    path = config(tmp_path, tls_ctrl.url)
    refused = invoke(path, "node", "get", "node-a")  # certifi's bundle: not trusted
    assert refused.exit_code == 13  # failed precondition: no retry can fix it
    assert "presented a certificate that does not verify" in refused.stderr
    assert "kibo enroll --ca-file" in refused.stderr
    assert tls_ctrl.requests == []
    monkeypatch.setenv("SSL_CERT_FILE", str(cert[0]))
    assert invoke(path, "node", "get", "node-a").exit_code == 0
    monkeypatch.delenv("SSL_CERT_FILE")
    # SSL_CERT_DIR holds certificates under OpenSSL's subject-hash names.
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("SSL_CERT_DIR needs openssl to name the file")
    digest = subprocess.run([openssl, "x509", "-hash", "-noout", "-in", str(cert[0])],
                            capture_output=True, text=True, check=True).stdout.strip()
    roots = tmp_path / "roots"
    roots.mkdir()
    (roots / f"{digest}.0").write_bytes(cert[0].read_bytes())
    monkeypatch.setenv("SSL_CERT_DIR", str(roots))
    assert invoke(path, "node", "get", "node-a").exit_code == 0
    assert len(tls_ctrl.sent("GET")) == 2


def test_the_host_name_is_checked(tmp_path, cert, monkeypatch):
    other = tmp_path / "other"
    other.mkdir()
    wrong = self_signed(other, names=("ctrl.example",), addresses=())
    server = FakeCtrlServer()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*wrong)
    server.server.socket = context.wrap_socket(server.server.socket, server_side=True)
    with server as fake:
        monkeypatch.setenv("SSL_CERT_FILE", str(wrong[0]))
        result = invoke(config(tmp_path, fake.url.replace("http://", "https://")), "node",
                        "get", "node-a")
        assert result.exit_code == 13
        assert "presented a certificate that does not verify" in result.stderr
        assert "IP address mismatch" in result.stderr or "match" in result.stderr
        assert fake.requests == []


def test_http_through_a_proxy_with_credentials(tmp_path, kibo_toml, fake_ctrl, monkeypatch):
    fake_ctrl.route("GET", "/v1/nodes/node-a", (200, {"result": node()}))
    with Proxy() as proxy:
        host_port = proxy.url.removeprefix("http://")
        monkeypatch.setenv("HTTP_PROXY", f"http://op%40x:p%3Ass@{host_port}")
        result = invoke(kibo_toml, "node", "get", "node-a")
        assert result.exit_code == 0, result.stderr
        assert "node-a" in result.stdout
        line, auth = proxy.seen[0]
        assert line == f"GET {fake_ctrl.url}/v1/nodes/node-a HTTP/1.1"
        assert auth == "Basic " + base64.b64encode(b"op@x:p:ss").decode()
        # no_proxy names the ctrl host: straight there.
        monkeypatch.setenv("NO_PROXY", "example.com, 127.0.0.1")
        assert invoke(kibo_toml, "node", "get", "node-a").exit_code == 0
        assert len(proxy.seen) == 1
        assert len(fake_ctrl.sent("GET")) == 2


def test_https_through_a_connect_tunnel(tmp_path, tls_ctrl, cert, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(cert[0]))
    with Proxy() as proxy:
        monkeypatch.setenv("https_proxy", proxy.url)
        monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # not for https
        result = invoke(config(tmp_path, tls_ctrl.url), "node", "get", "node-a")
        assert result.exit_code == 0, result.stderr
        netloc = tls_ctrl.url.removeprefix("https://")
        assert [(line.rsplit(" ", 1)[0], auth) for line, auth in proxy.seen] == [
            (f"CONNECT {netloc}", None)]  # HTTP/1.0 or 1.1, as http.client speaks it
        assert tls_ctrl.sent("GET")[0].headers["authorization"] == "Bearer kid-x:secret"


@pytest.mark.parametrize(("no_proxy", "host", "bypassed"), [
    ("*", "ctrl.example", True),
    ("example.com", "example.com", True),
    ("example.com", "ctrl.example.com", True),
    ("example.com", "badexample.com", False),
    (".example.com", "example.com", False),
    (".example.com", "ctrl.example.com", True),
    ("localhost", "localhost", True),
    ("10.0.0.1", "10.0.0.1", True),
    ("10.0.0.1", "10.0.0.10", False),
    ("::1", "::1", True),
    ("http://ctrl.example", "ctrl.example", True),
    ("https://ctrl.example", "ctrl.example", False),  # this test's target is http
    ("", "ctrl.example", False),
])
def test_no_proxy_rules_are_httpx_rules(monkeypatch, no_proxy, host, bypassed):
    monkeypatch.setenv("ALL_PROXY", "proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", no_proxy)
    url = f"http://[{host}]:7400" if ":" in host else f"http://{host}:7400"
    found = proxy_for(Target.parse(url))
    assert (found is None) == bypassed
    if found is not None:
        assert (found.host, found.port, found.authorization) == ("proxy.example", 3128, None)


def test_only_http_proxies(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "socks5://127.0.0.1:1080")
    with pytest.raises(InvalidArgument, match="http:// proxies only"):
        proxy_for(Target.parse("https://ctrl.example"))


def test_a_connection_closed_while_idle_is_not_reused(fake_ctrl, monkeypatch):
    """After the server closed the kept-alive connection, the next request opens a new
    one at once: with retries off, a client that reused the dead one would fail."""
    monkeypatch.setattr("kibotos.cli.core.client.RETRY_PAUSES", ())
    fake_ctrl.route("GET", "/v1/nodes/node-a", (200, {"result": node()}))
    with Client(fake_ctrl.url, None) as client:
        client.get("/v1/nodes/node-a")
        sock = client._http._sock
        assert sock is not None
        sock.shutdown(socket.SHUT_WR)  # the server sees the end and closes its side
        ready, _, _ = select.select([sock], [], [], 30)
        assert ready  # the close has arrived: the connection is dead and idle
        assert client.get("/v1/nodes/node-a")["node_id"] == "node-a"
    assert len(fake_ctrl.sent("GET")) == 2


def test_unreachable_names_the_url(tmp_path):
    with pytest.raises(Unavailable, match=r"cannot reach ctrl at http://127\.0\.0\.1:9: "
                                          r"connection failed \("), Client(
            "http://127.0.0.1:9", None) as client:
        client.get("/v1/nodes")
