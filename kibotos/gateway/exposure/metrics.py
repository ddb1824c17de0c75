"""The Exposure gateway's Prometheus metrics (docs/metrics.md, "Exposure gateway
metrics"), one registry per gateway process, served on ``metrics_listen``.

Labels are bounded sets: the status code, the kind (``http``, or ``websocket`` for
an upgrade the sandbox accepted) and the direction; never a sandbox ID or a host.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.requests import Request
from starlette.responses import Response

#: From a cached loopback hop to a slow application in a microVM.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
           30.0, 60.0, 300.0)


class ExposureMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kibotos_gateway_exposure_http_requests", "Requests answered, by status code "
            "and kind (http; websocket: upgraded, status 101)", ["status", "kind"],
            registry=r)
        self.latency = Histogram(
            "kibotos_gateway_exposure_http_request_duration_seconds", "From a request's "
            "head to the end of its answer (an upgrade: to the 101)", buckets=BUCKETS,
            registry=r)
        self.connections = Gauge(
            "kibotos_gateway_exposure_client_connections", "Client connections open now",
            registry=r)
        self.streams = Gauge(
            "kibotos_gateway_exposure_open_streams", "Port streams to sandboxes open now "
            "(kept-alive and upgraded connections included)", registry=r)
        self.resumes = Counter(
            "kibotos_gateway_exposure_sandbox_resumes", "Wakes of paused autoResume "
            "sandboxes by requests, by outcome (started: this gateway started it; "
            "joined: a start under way was waited on; failed)", ["outcome"], registry=r)
        self.bytes = Counter(
            "kibotos_gateway_exposure_bytes", "Bytes relayed, by direction (to_sandbox, "
            "from_sandbox), HTTP heads and bodies and upgraded streams alike",
            ["direction"], registry=r)

    async def endpoint(self, request: Request) -> Response:
        """``GET /metrics``: the Prometheus text format."""
        return Response(generate_latest(self.registry),
                        media_type="text/plain; version=0.0.4; charset=utf-8")
