"""The proxy's side towards a sandbox: one port stream (`kibotos.dataplane.clients.ports_client`)
with an HTTP/1.1 client state machine (h11) on it, kept for the next request of the
same client connection to the same sandbox port (keep-alive both ways).

Opening one asks ctrl's record (`SandboxAccess`) and the data plane; a credential the
data plane no longer takes, or an Instance that moved, is retried once with a fresh
session.  Nothing listening on the port is `PortClosed`, which the proxy answers 502.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import h11

from kibotos.core.errors import (
    KibotosError,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kibotos.dataplane.clients.ports_client import PortConnection, open_port
from kibotos.gateway.exposure.access import SandboxAccess
from kibotos.gateway.exposure.metrics import ExposureMetrics
from kibotos.gateway.exposure.routing import Target

#: Bytes read from a stream at a time: what one connection holds per direction.
CHUNK = 64 * 1024
#: The longest response head accepted from a sandbox (h11 refuses a longer one).
MAX_HEAD = 64 * 1024
#: How long the data plane may take to accept a port stream.
CONNECT_TIMEOUT = 30.0


class PortClosed(KibotosError):
    """Nothing listens on the port in the sandbox (HTTP 502)."""

    code = "unavailable"
    http_status = 502


class Upstream:
    """One open port stream to `target`; `aclose` ends it."""

    def __init__(self, target: Target, stream: PortConnection, stack: AsyncExitStack,
                 metrics: ExposureMetrics) -> None:
        self.target = target
        self.stream = stream
        self.http = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        self._stack = stack
        self._metrics = metrics
        self._to = metrics.bytes.labels("to_sandbox")
        self._from = metrics.bytes.labels("from_sandbox")
        metrics.streams.inc()

    @property
    def reusable(self) -> bool:
        """The last exchange ended cleanly on both sides: the next request may follow."""
        return self.http.our_state is h11.DONE and self.http.their_state is h11.DONE

    async def send(self, event: h11.Event) -> None:
        data = self.http.send(event)
        if data:
            await self.send_raw(data)

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)
        self._to.inc(len(data))

    async def receive_raw(self) -> bytes:
        data = await self.stream.receive_some(CHUNK)
        self._from.inc(len(data))
        return data

    async def next_event(self) -> h11.Event | type[h11.PAUSED]:
        """The sandbox's next HTTP event; `h11.ConnectionClosed` at its EOF."""
        while True:
            event = self.http.next_event()
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]
            self.http.receive_data(await self.receive_raw())

    async def aclose(self) -> None:
        """End the stream.  Called where it was opened (the data-plane WebSocket's
        nursery must close at the nesting it opened at, so no cancel scope here)."""
        self._metrics.streams.dec()
        await self._stack.aclose()


async def open_upstream(access: SandboxAccess, target: Target, traffic_token: str | None,
                        metrics: ExposureMetrics) -> Upstream:
    """A port stream to `target`, if its traffic may pass (`SandboxAccess.open`)."""
    for attempt in (1, 2):
        session = await access.open(target, traffic_token)
        stack = AsyncExitStack()
        try:
            stream = await stack.enter_async_context(open_port(
                session.url, session.credential, target.port,
                connect_timeout=CONNECT_TIMEOUT, ssl_context=session.tls))
        except Unavailable as exc:
            await stack.aclose()
            if exc.details.get("reason") == "connection_refused":
                raise PortClosed(f"nothing listens on port {target.port} in sandbox "
                                 f"{target.sandbox_id}") from None
            access.forget(target)
            raise
        except (Unauthenticated, PermissionDenied, NotFound):
            await stack.aclose()
            access.forget(target)  # a stale credential, or the Instance moved
            if attempt == 2:
                raise Unavailable(f"the data plane of sandbox {target.sandbox_id} refused "
                                  "the gateway's session credential") from None
            continue
        except BaseException:
            await stack.aclose()
            raise
        return Upstream(target, stream, stack, metrics)
    raise AssertionError("unreachable")
