"""The Exposure gateway in front of the E2B gateway's test cluster (test VMM: the real
node, data plane and guest agent; the sandbox's processes run for real): the official
SDK's ``get_host(port)`` reached through it by host name and by E2B's header form,
keep-alive, WebSocket passthrough, 502 for a closed port, 404 for an unknown sandbox,
the traffic access token of a sandbox created with ``allow_public_traffic: false``, and
large bodies streamed both ways with the gateway's memory flat, and the same over TLS
from a second gateway process given a certificate.  A server
(`exposure_server.py`) runs inside each sandbox."""

from __future__ import annotations

import datetime as dt
import hashlib
import http.client
import re
import socket
import ssl
import subprocess
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import trio
from e2b import NotFoundException, Sandbox
from exposure_proc import PATTERN, free_port, gateway_pid, serve
from gateway_proc import E2bSetup
from trio_websocket import open_websocket_url

from kibotos.dev.cluster import script
from kibotos.testing.waiting import wait_until_sync
from kibotos.tls.ca import ClusterCA

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def public(e2b: E2bSetup) -> Iterator[tuple[Sandbox, int]]:
    sbx = Sandbox.create("base", **e2b.opts())
    try:
        yield sbx, serve(e2b, sbx)
    finally:
        sbx.kill()


def _get(e2b: E2bSetup, path: str, **headers: str) -> httpx.Response:
    return httpx.get(f"{e2b.gateway.exposure_url}{path}", headers=headers, timeout=60)


def _metrics(e2b: E2bSetup) -> str:
    address = (e2b.cluster.dir / "gateway-exposure/state/metrics-listen-address").read_text()
    return httpx.get(f"http://{address.strip()}/metrics").text


def test_get_host_is_reached_by_host_name_and_by_headers(
        e2b: E2bSetup, public: tuple[Sandbox, int]) -> None:
    sbx, port = public
    host = sbx.get_host(port)
    assert host == f"{port}-{sbx.sandbox_id}.kibotos.localhost"
    by_host = _get(e2b, "/hello", Host=host)
    assert by_host.status_code == 200, by_host.text
    assert by_host.text == (f"hello /hello host={host} xff=127.0.0.1 token=False "
                            "routing=False\n")
    by_headers = _get(e2b, "/hello", **{"E2b-Sandbox-Id": sbx.sandbox_id,
                                        "E2b-Sandbox-Port": str(port)})
    assert by_headers.status_code == 200, by_headers.text
    assert by_headers.text.startswith("hello /hello host=127.0.0.1:")
    assert "routing=False" in by_headers.text
    assert _get(e2b, "/nothing", Host=host).status_code == 404  # the sandbox's own 404


def test_one_client_connection_carries_many_requests(
        e2b: E2bSetup, public: tuple[Sandbox, int]) -> None:
    sbx, port = public
    gateway = urlsplit(e2b.gateway.exposure_url)
    conn = http.client.HTTPConnection(gateway.hostname or "", gateway.port, timeout=60)
    try:
        sockets = []
        for _ in range(3):
            conn.request("GET", "/hello", headers={"Host": sbx.get_host(port)})
            answer = conn.getresponse()
            assert answer.status == 200
            assert answer.read().startswith(b"hello /hello")
            sockets.append(conn.sock)
        assert sockets[0] is not None
        assert sockets.count(sockets[0]) == 3
    finally:
        conn.close()


def test_a_closed_port_is_502_and_an_unknown_sandbox_404(
        e2b: E2bSetup, public: tuple[Sandbox, int]) -> None:
    sbx, _ = public
    closed = free_port()
    refused = _get(e2b, "/", Host=sbx.get_host(closed))
    assert refused.status_code == 502
    assert f"nothing listens on port {closed} in sandbox {sbx.sandbox_id}" in refused.text
    unknown = _get(e2b, "/", Host=f"8000-{'0' * 26}.kibotos.localhost")
    assert unknown.status_code == 404
    assert "not found" in unknown.text
    assert _get(e2b, "/", Host="example.org").status_code == 404
    assert _get(e2b, "/", Host=f"8000-{sbx.sandbox_id}.other.example").status_code == 404
    half = _get(e2b, "/", **{"E2b-Sandbox-Id": sbx.sandbox_id})
    assert half.status_code == 400


def test_websocket_upgrades_pass_through(e2b: E2bSetup, public: tuple[Sandbox, int]) -> None:
    sbx, port = public
    url = e2b.gateway.exposure_url.replace("http://", "ws://") + "/ws"
    heard: list[str] = []

    async def talk() -> None:
        with trio.fail_after(60):
            async with open_websocket_url(url, extra_headers=[
                    ("E2b-Sandbox-Id", sbx.sandbox_id),
                    ("E2b-Sandbox-Port", str(port))]) as ws:
                for text in ("hello", "x" * 300):
                    await ws.send_message(text)
                    heard.append(str(await ws.get_message()))

    trio.run(talk)
    assert heard == ["echo: hello", "echo: " + "x" * 300]
    assert re.search(r'kibotos_gateway_exposure_http_requests_total\{kind="websocket",'
                     r'status="101"\} [1-9]', _metrics(e2b))


def test_a_private_sandbox_needs_its_traffic_token(e2b: E2bSetup) -> None:
    sbx = Sandbox.create("base", network={"allow_public_traffic": False}, **e2b.opts())
    try:
        token = sbx.traffic_access_token
        assert isinstance(token, str)
        assert len(token) >= 40
        port = serve(e2b, sbx, token)
        host = sbx.get_host(port)
        assert _get(e2b, "/hello", Host=host).status_code == 403
        wrong = _get(e2b, "/hello", Host=host, **{"e2b-traffic-access-token": "x" * 43})
        assert wrong.status_code == 403
        assert "e2b-traffic-access-token" in wrong.text
        right = _get(e2b, "/hello", Host=host, **{"e2b-traffic-access-token": token})
        assert right.status_code == 200
        assert "token=False" in right.text  # the token stops at the gateway
        # Connect hands the token out again, to the team only; a get shows no secret,
        # ctrl only a digest.
        assert Sandbox.connect(sbx.sandbox_id, **e2b.opts()).traffic_access_token == token
        with pytest.raises(NotFoundException):
            Sandbox.connect(sbx.sandbox_id, **e2b.opts(e2b.other_key))
        shown = httpx.get(f"{e2b.gateway.api_url}/sandboxes/{sbx.sandbox_id}",
                          headers={"X-API-Key": e2b.key})
        assert shown.status_code == 200
        assert token not in shown.text
        ws = e2b.cluster.api("GET", f"/v1/workspaces/ws-{sbx.sandbox_id}")
        assert token not in str(ws)
        assert set(ws["labels"]) == {"e2b.team", "e2b.traffic-token-sha256"}
    finally:
        sbx.kill()


def _peak_rss(e2b: E2bSetup) -> int:
    status = Path(f"/proc/{gateway_pid(e2b)}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) << 10  # type: ignore[union-attr]


def test_large_bodies_stream_both_ways_with_flat_memory(
        e2b: E2bSetup, public: tuple[Sandbox, int]) -> None:
    sbx, port = public
    size = 128 << 20
    url = e2b.gateway.exposure_url
    headers = {"Host": sbx.get_host(port)}
    before = _peak_rss(e2b)

    def body() -> Iterator[bytes]:
        for _ in range(size // len(PATTERN)):
            yield PATTERN

    expected = hashlib.sha256()
    for chunk in body():
        expected.update(chunk)
    with httpx.Client(timeout=300) as client:
        up = client.post(f"{url}/sha256", content=body(), headers=headers)
        assert up.status_code == 200, up.text
        assert up.text == f"{expected.hexdigest()} {size}\n"
        got, length = hashlib.sha256(), 0
        with client.stream("GET", f"{url}/blob?n={size}", headers=headers) as down:
            assert down.status_code == 200
            for chunk in down.iter_bytes():
                got.update(chunk)
                length += len(chunk)
    assert (length, got.hexdigest()) == (size, expected.hexdigest())
    grown = _peak_rss(e2b) - before
    assert grown < 32 << 20, f"the gateway's peak memory grew by {grown >> 20} MiB"


def _raw(e2b: E2bSetup, data: bytes) -> bytes:
    """Send `data` on a fresh connection to the gateway; all it answers until it closes."""
    return _raw_to(e2b.gateway.exposure_url.removeprefix("http://"), data)


def _raw_to(address: str, data: bytes) -> bytes:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(data)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def test_malformed_and_old_requests_do_not_hurt_the_gateway(
        e2b: E2bSetup, public: tuple[Sandbox, int]) -> None:
    sbx, port = public
    assert _raw(e2b, b"NOT HTTP AT ALL\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    old = _raw(e2b, (f"GET /hello HTTP/1.0\r\nE2b-Sandbox-Id: {sbx.sandbox_id}\r\n"
                     f"E2b-Sandbox-Port: {port}\r\n\r\n").encode())
    assert old.startswith(b"HTTP/1.1 200 "), old[:200]
    assert b"hello /hello host=127.0.0.1:" in old
    assert _get(e2b, "/hello", Host=sbx.get_host(port)).status_code == 200  # still serving


@contextmanager
def _second_gateway(e2b: E2bSetup, tmp_path: Path, sections: str) -> Iterator[str]:
    """Another ``kibotos gateway exposure serve`` process (the dev cluster's gateway
    identity, `sections` of TOML added) for the block; its ``host:port``.  It must stop
    cleanly on SIGTERM."""
    ctrl = tomllib.loads((e2b.cluster.dir / "gateway-exposure/gateway.toml").read_text())
    ctrl_lines = "".join(f'{k} = "{v}"\n' for k, v in ctrl["ctrl"].items())
    config = tmp_path / "gateway.toml"
    config.write_text(f'listen = "127.0.0.1:0"\nmetrics_listen = "127.0.0.1:0"\n'
                      f'state_dir = "{tmp_path / "state"}"\ndomain = "kibotos.localhost"\n'
                      f"[ctrl]\n{ctrl_lines}{sections}")
    with open(tmp_path / "gateway.log", "wb") as log:
        proc = subprocess.Popen([script("kibotos"), "gateway", "exposure", "serve",
                                 "--config", str(config)], stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL)
    try:
        listen_file = tmp_path / "state/listen-address"
        yield wait_until_sync(
            lambda: listen_file.read_text().strip() if listen_file.exists() else None,
            "the second gateway listens", timeout=60)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, (tmp_path / "gateway.log").read_text()[-2000:]


def test_the_gateway_serves_tls_when_given_a_certificate(
        e2b: E2bSetup, public: tuple[Sandbox, int], tmp_path: Path) -> None:
    """A second Exposure gateway with a certificate of a CA made here answers over
    TLS, and not in plain."""
    sbx, port = public
    ca = ClusterCA.generate()
    # For the address the client dials (a deployment's would be *.<domain>, which this
    # CA helper does not issue).
    issued = ca.issue(["127.0.0.1"], lifetime=dt.timedelta(days=1))
    assert issued.key_pem is not None
    (tmp_path / "gw.crt").write_bytes(issued.cert_pem)
    (tmp_path / "gw.key").write_bytes(issued.key_pem)
    tls = (f"[tls]\ncert_file = \"{tmp_path / 'gw.crt'}\"\n"
           f"key_file = \"{tmp_path / 'gw.key'}\"\n")
    with _second_gateway(e2b, tmp_path, tls) as address:
        trusted = ssl.create_default_context(cadata=ca.cert_pem.decode())
        got = httpx.get(f"https://{address}/hello", headers={"Host": sbx.get_host(port)},
                        verify=trusted, timeout=60)
        assert got.status_code == 200, got.text
        assert got.text.startswith(f"hello /hello host={sbx.get_host(port)} ")
        with pytest.raises(httpx.TransportError):  # a client that expects plain HTTP
            httpx.get(f"http://{address}/hello", headers={"Host": sbx.get_host(port)},
                      timeout=10)


def test_connection_limits_refuse_the_extra_one_and_close_idle_ones(
        e2b: E2bSetup, public: tuple[Sandbox, int], tmp_path: Path) -> None:
    """With ``max_connections = 1`` a second client connection is answered 503 while
    the first is open; the first, left idle, is closed by the gateway itself."""
    sbx, port = public
    limits = "[limits]\nmax_connections = 1\nidle_timeout_s = 2\n"
    with _second_gateway(e2b, tmp_path, limits) as address:
        host, _, listen_port = address.rpartition(":")
        with socket.create_connection((host, int(listen_port)), timeout=120) as first:
            first.sendall(f"GET /hello HTTP/1.1\r\nHost: {sbx.get_host(port)}\r\n\r\n"
                          .encode())
            answer = first.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
            busy = _raw_to(address, f"GET /hello HTTP/1.1\r\nHost: {sbx.get_host(port)}"
                                    "\r\n\r\n".encode())
            assert busy.startswith(b"HTTP/1.1 503 "), busy[:200]
            assert b"too many connections" in busy
            while chunk := first.recv(65536):  # the rest of the answer, then the close
                assert b"HTTP/1.1" not in chunk
