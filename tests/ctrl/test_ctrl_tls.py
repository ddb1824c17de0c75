"""ctrl's HTTPS (kibotos/ctrl/tls.py), over real TLS on loopback: plain HTTP refused
off loopback and served on loopback when asked; the operator's certificate served,
not the cluster CA's, and reloaded when its files change; the issued certificate
renewed when due.  A reload or renewal changes what new handshakes get, while a
connection established before keeps working."""

from __future__ import annotations

import datetime as dt
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from click.testing import CliRunner
from cryptography import x509
from ctrl_helpers import make_config, result
from hypercorn.trio import serve as hypercorn_serve

from kibotos.cli.main import kibotos_cli
from kibotos.config import CtrlConfig, parse
from kibotos.core.errors import InvalidArgument
from kibotos.ctrl.api.app import build_app
from kibotos.ctrl.serve import (
    build_context,
    build_services,
    hypercorn_config,
    open_store,
    prepare_tls,
    serve_ctrl,
)
from kibotos.ctrl.tls import LIFETIME, CtrlTls, server_names
from kibotos.tls.ca import ClusterCA, cert_path
from kibotos.tls.contexts import client_context
from kibotos.tls.local_ctrl import client_tls, ctrl_url
from kibotos.tls.server import write_pair


def config_with(tmp_path: Path, **tls: Any) -> CtrlConfig:
    base = make_config(tmp_path)
    return CtrlConfig.model_validate({**base.model_dump(), "tls": tls})


@asynccontextmanager
async def serving(config: CtrlConfig) -> AsyncIterator[tuple[str, CtrlTls]]:
    """ctrl's app on loopback with `config`'s TLS; the address and the `CtrlTls`."""
    store = await open_store(config)
    ctx = build_context(config, store)
    try:
        tls = prepare_tls(config, ctx)
        assert tls is not None
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(
                hypercorn_serve, build_app(build_services(ctx)),
                hypercorn_config(config.ctrl.listen, tls)))
            yield binds[0].split("://", 1)[1], tls
            nursery.cancel_scope.cancel()
    finally:
        store.close()


async def connect(address: str, verify: ssl.SSLContext,
                  name: str = "127.0.0.1") -> trio.SSLStream[trio.SocketStream]:
    host, _, port = address.rpartition(":")
    stream = trio.SSLStream(await trio.open_tcp_stream(host, int(port)), verify,
                            server_hostname=name, https_compatible=True)
    try:
        await stream.do_handshake()
    except trio.BrokenResourceError as exc:  # trio wraps the TLS error
        await stream.aclose()
        if isinstance(exc.__cause__, ssl.SSLError):
            raise exc.__cause__ from None
        raise
    return stream


def serial(stream: trio.SSLStream[trio.SocketStream]) -> int:
    der = stream.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


async def served_serial(address: str, verify: ssl.SSLContext) -> int:
    """The serial of the certificate a new handshake gets."""
    stream = await connect(address, verify)
    try:
        return serial(stream)
    finally:
        await stream.aclose()


async def health_over(stream: trio.SSLStream[trio.SocketStream]) -> bytes:
    """One ``GET /v1/health`` on an open connection; the status line."""
    await stream.send_all(b"GET /v1/health HTTP/1.1\r\nHost: ctrl\r\n\r\n")
    data = b""
    with trio.fail_after(30):
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(4096)
    return data.split(b"\r\n", 1)[0]


def test_plain_http_is_refused_off_loopback(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="allowed only on a loopback address"):
        parse(CtrlConfig, {"ctrl": {"listen": "0.0.0.0:7400"}, "tls": {"enabled": False}},
              "ctrl.toml")
    path = tmp_path / "ctrl.toml"
    path.write_text(f'[ctrl]\nlisten = "192.0.2.1:7400"\nstate_dir = "{tmp_path / "s"}"\n'
                    "[tls]\nenabled = false\n")
    out = CliRunner().invoke(kibotos_cli, ["ctrl", "serve", "--config", str(path)])
    assert out.exit_code == 10, out.output
    assert "tls.enabled = false (plain HTTP) is allowed only on a loopback" in out.stderr
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(("tls", "text"), [
    ({"cert_file": "/x.crt"}, "cert_file and key_file go together"),
    ({"enabled": False, "server_names": ["ctrl.example"]}, "have no use then"),
    ({"enabled": "no"}, "tls.enabled"),
])
def test_bad_tls_settings_name_the_key(tmp_path: Path, tls: dict[str, Any],
                                       text: str) -> None:
    with pytest.raises(InvalidArgument, match=text):
        parse(CtrlConfig, {"ctrl": {"listen": "127.0.0.1:0"}, "tls": tls}, "ctrl.toml")


async def test_plain_http_on_loopback_when_asked(tmp_path: Path) -> None:
    config = config_with(tmp_path, enabled=False)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(partial(serve_ctrl, config, handle_signals=False))
        url = ctrl_url(config, address)
        assert url.startswith("http://")
        async with httpx.AsyncClient(base_url=url) as http:
            assert result(await http.get("/v1/health"))["status"] == "ok"
        nursery.cancel_scope.cancel()


async def test_an_issued_certificate_is_refused_by_a_client_without_the_ca(
        tmp_path: Path) -> None:
    config = make_config(tmp_path)
    async with serving(config) as (address, _tls):
        with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer"):
            await connect(address, client_context())  # the system store
        with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
            await connect(address, client_tls(config), name="elsewhere.example")
        stream = await connect(address, client_tls(config), name="localhost")
        assert await health_over(stream) == b"HTTP/1.1 200 "
        await stream.aclose()


async def test_the_operators_certificate_is_served_and_reloaded(tmp_path: Path) -> None:
    corporate = ClusterCA.generate()
    cert_file, key_file = tmp_path / "ctrl.crt", tmp_path / "ctrl.key"

    def install() -> None:
        issued = corporate.issue(["127.0.0.1"], lifetime=dt.timedelta(days=1))
        assert issued.key_pem is not None
        write_pair(cert_file, key_file, issued.cert_pem, issued.key_pem)

    install()
    config = config_with(tmp_path, cert_file=str(cert_file), key_file=str(key_file))
    trusting = client_context(corporate.cert_pem)
    async with serving(config) as (address, tls):
        # The cluster CA did not sign what ctrl serves: the operator's CA did.
        with pytest.raises(ssl.SSLCertVerificationError):
            await connect(address, client_context(
                cert_path(config.ctrl.state_dir).read_bytes()))
        before = await connect(address, trusting)
        first = serial(before)
        tls.check()  # nothing changed: nothing reloaded
        assert await served_serial(address, trusting) == first
        install()  # the operator's renewal
        tls.check()
        after = await connect(address, trusting)
        assert serial(after) != first
        assert await health_over(before) == b"HTTP/1.1 200 "  # established: unaffected
        assert await health_over(after) == b"HTTP/1.1 200 "
        # A broken file keeps the certificate being served.
        cert_file.write_text("not a certificate\n")
        tls.check()
        assert await served_serial(address, trusting) == serial(after)
        for stream in (before, after):
            await stream.aclose()


async def test_the_issued_certificate_is_renewed_when_due(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    async with serving(config) as (address, tls):
        verify = client_tls(config)
        fresh = await served_serial(address, verify)
        tls.check()  # fresh: not due
        assert await served_serial(address, verify) == fresh
        # A certificate issued 70 % of its lifetime ago, as after two months of serving.
        tls.issue(now=dt.datetime.now(dt.UTC) - LIFETIME * 0.7)
        before = await connect(address, verify)
        old = serial(before)
        tls.check()
        assert tls.server.not_after is not None
        assert tls.server.not_after > dt.datetime.now(dt.UTC) + LIFETIME * 0.9
        after = await connect(address, verify)
        assert serial(after) not in (old, fresh)
        assert await health_over(before) == b"HTTP/1.1 200 "  # established: unaffected
        assert await health_over(after) == b"HTTP/1.1 200 "
        for stream in (before, after):
            await stream.aclose()


def test_issued_names_skip_a_host_name_that_is_no_dns_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = config_with(tmp_path, server_names=["ctrl.example"])
    monkeypatch.setattr("socket.gethostname", lambda: "build_host")
    assert server_names(config) == ["ctrl.example", "127.0.0.1", "localhost", "::1"]
    monkeypatch.setattr("socket.gethostname", lambda: "ctrl-7")
    assert "ctrl-7" in server_names(config)
