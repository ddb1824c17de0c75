"""TLS pieces of the data-plane tests: certificates from a real cluster CA (in memory,
any lifetime), handing them to a data plane over its control socket, and what a new
handshake sees."""

from __future__ import annotations

import datetime as dt
import ssl
from pathlib import Path
from typing import Any

import trio
from cryptography import x509

from kibotos.dataplane.clients.client import ExecClient, Output
from kibotos.dataplane.process.control import control_call
from kibotos.tls.ca import ClusterCA
from kibotos.tls.contexts import client_context

TIMEOUT = 60


class TestCA:
    """A cluster CA and the client context that trusts only it."""

    __test__ = False  # not a test class

    def __init__(self) -> None:
        self.ca = ClusterCA.generate()
        self.client = client_context(self.ca.cert_pem)

    def pair(self, lifetime: float = 3600.0, name: str = "127.0.0.1") -> tuple[str, str]:
        issued = self.ca.issue([name], lifetime=dt.timedelta(seconds=lifetime))
        assert issued.key_pem is not None
        return issued.cert_pem.decode(), issued.key_pem.decode()


def serial_of(cert_pem: str) -> str:
    return f"{x509.load_pem_x509_certificate(cert_pem.encode()).serial_number:x}"


async def supply(control: Path, cert_pem: str, key_pem: str) -> dict[str, Any]:
    return await control_call(control, {"type": "certificate", "certificate": cert_pem,
                                        "key": key_pem}, timeout=TIMEOUT)


async def handshake_serial(listen: str, context: ssl.SSLContext) -> str:
    """A new TLS connection to `listen`, verified with `context`: the serial of the
    certificate it was served (an `ssl.SSLError` when the handshake fails)."""
    host, _, port = listen.rpartition(":")
    with trio.fail_after(TIMEOUT):
        stream = await trio.open_ssl_over_tcp_stream(host, int(port), ssl_context=context,
                                                     https_compatible=True)
        try:
            await stream.do_handshake()
            der = stream.getpeercert(binary_form=True)
        finally:
            await trio.aclose_forcefully(stream)
    assert der is not None
    return f"{x509.load_der_x509_certificate(der).serial_number:x}"


async def handshake_error(listen: str, context: ssl.SSLContext) -> BaseException:
    """The error a new handshake with `listen` fails with (the test expects one)."""
    try:
        serial = await handshake_serial(listen, context)
    except (ssl.SSLError, trio.BrokenResourceError) as exc:
        return exc
    raise AssertionError(f"the handshake succeeded (serial {serial})")


async def echo(ex: ExecClient, line: bytes) -> bytes:
    """Send `line` to a running ``cat`` and read it back."""
    await ex.send_stdin(line)
    got = b""
    with trio.fail_after(TIMEOUT):
        async for event in ex.events():
            if isinstance(event, Output):
                got += event.data
                if got.endswith(b"\n"):
                    return got
    raise AssertionError(f"cat ended after {got!r}")
