"""The E2B gateway's Prometheus metrics (docs/metrics.md, "E2B gateway metrics") and
the ASGI middleware that keeps them, one registry per gateway process.

Both listeners are counted, labelled ``api`` = ``control`` (E2B's API) or ``envd``:
requests by route template, method and status, their latency, the requests in flight
(a ``Start`` stream is one for as long as the process runs), and body bytes each way.
Labels are bounded sets: the route is the route template (``/sandboxes/{sandbox_id}``,
``/process.Process/Start``), ``unmatched`` for a path no route has.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.requests import Request
from starlette.responses import Response

ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]],
                    Callable[[MutableMapping[str, Any]], Awaitable[None]]], Awaitable[None]]
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
#: From milliseconds (a stat) to a create that boots a microVM, to long commands.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
           300.0, 3600.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kibotos_gateway_e2b_http_requests", "Requests answered, by API, route "
            "template, method and status", ["api", "route", "method", "status"], registry=r)
        self.latency = Histogram(
            "kibotos_gateway_e2b_http_request_duration_seconds", "From a request's arrival "
            "to the end of its answer (a stream: until it ends)", ["api", "route"],
            buckets=BUCKETS, registry=r)
        self.in_flight = Gauge(
            "kibotos_gateway_e2b_http_requests_in_flight", "Requests being answered now, "
            "streams included", ["api"], registry=r)
        self.resumes = Counter(
            "kibotos_gateway_e2b_sandbox_resumes", "Wakes of paused autoResume sandboxes "
            "by envd calls, by outcome (started: this gateway started it; joined: a "
            "start under way was waited on; failed)", ["outcome"], registry=r)
        self.bytes = Counter(
            "kibotos_gateway_e2b_http_body_bytes", "Body bytes, by API and direction "
            "(in: from clients, out: to them)", ["api", "direction"], registry=r)

    def middleware(self, app: ASGIApp, api: str) -> ASGIApp:
        """`app`, counted under ``api``."""

        async def counted(scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                          send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            started, status = time.perf_counter(), 500
            body_in, body_out = self.bytes.labels(api, "in"), self.bytes.labels(api, "out")

            async def counting_receive() -> Any:
                message = await receive()
                if message.get("type") == "http.request":
                    body_in.inc(len(message.get("body", b"")))
                return message

            async def counting_send(message: MutableMapping[str, Any]) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                elif message["type"] == "http.response.body":
                    body_out.inc(len(message.get("body", b"")))
                await send(message)

            gauge = self.in_flight.labels(api)
            gauge.inc()
            try:
                await app(scope, counting_receive, counting_send)
            finally:
                gauge.dec()
                route = getattr(scope.get("route"), "path", None)
                route = route if isinstance(route, str) else "unmatched"
                method = str(scope.get("method", ""))
                self.requests.labels(api, route, method if method in METHODS else "other",
                                     str(status)).inc()
                self.latency.labels(api, route).observe(time.perf_counter() - started)

        return counted

    async def endpoint(self, request: Request) -> Response:
        """``GET /metrics``: the Prometheus text format."""
        return Response(generate_latest(self.registry),
                        media_type="text/plain; version=0.0.4; charset=utf-8")
