"""How the data plane's clients open TLS: the handshake at once, so a certificate that
does not verify is reported as that, at once, naming what it is checked against.

trio's `SSLStream` hands shakes on its first read or write; left to itself, a client
whose first act is to wait for an answer would sit until its timeout and then report a
slow data plane.  A verification failure cannot be fixed by retrying, so it is a
`FailedPrecondition` (kibo's exit code 13, as for ctrl's certificate); the common case
is the spec's: the node has been stopped, or cut off from ctrl, past the end of its
certificate.
"""

from __future__ import annotations

import ssl

import trio

from kibotos.core.errors import DeadlineExceeded, FailedPrecondition, KibotosError, Unavailable
from kibotos.tls.contexts import verification_error


def unverified(url: str, verify_message: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"the data plane at {url} presented a certificate that does not verify "
        f"({verify_message}): it is checked against the cluster CA (kibo: cluster_ca in "
        "kibo.toml, from `kibo enroll`); an expired one means its node has been stopped "
        "or cut off from ctrl since it last renewed it")


def handshake_failure(exc: BaseException, url: str) -> KibotosError:
    """The error a failed TLS handshake with the data plane at `url` stands for."""
    failed = verification_error(exc)
    if failed is not None:
        return unverified(url, failed.verify_message or str(failed))
    return Unavailable(f"TLS handshake with the data plane at {url} failed: "
                       f"{exc.__cause__ or exc!r} (a data plane that has no certificate yet "
                       "ends every handshake: see its node's log)")


async def open_tls_stream(host: str, port: int, context: ssl.SSLContext | None,
                          url: str) -> trio.SSLStream[trio.SocketStream]:
    """A TLS stream to `host`:`port`, handshake done, verified with `context` (None:
    the system store).  `OSError` when the connection cannot be made."""
    stream = await trio.open_ssl_over_tcp_stream(
        host, port, ssl_context=context or ssl.create_default_context(),
        https_compatible=True)
    try:
        await stream.do_handshake()
    except (trio.BrokenResourceError, ssl.SSLError) as exc:
        await trio.aclose_forcefully(stream)
        raise handshake_failure(exc, url) from None
    return stream


async def connect_dataplane(host: str, port: int, *, tls: bool,
                            context: ssl.SSLContext | None, url: str,
                            timeout: float
                            ) -> trio.SocketStream | trio.SSLStream[trio.SocketStream]:
    """The byte stream every data-plane client starts from: TCP to `host`:`port`, TLS
    (handshake done) when `tls`, within `timeout`; a connection that cannot be made or
    takes too long is the `KibotosError` that says so, naming `url`."""
    try:
        with trio.fail_after(timeout):
            if tls:
                return await open_tls_stream(host, port, context, url)
            return await trio.open_tcp_stream(host, port)
    except trio.TooSlowError:
        raise DeadlineExceeded(f"the data plane at {url} did not accept a connection "
                               f"within {timeout:g}s") from None
    except OSError as exc:
        raise Unavailable(f"cannot reach the data plane at {url}: {exc}") from None
