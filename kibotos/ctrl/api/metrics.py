"""ctrl's own Prometheus counters, the request middleware and ``GET /metrics``.

Every ctrl has its own `CollectorRegistry` (never prometheus-client's global one):
tests and benchmarks run several ctrls in one process, and each must count only its own
requests.  Counters and histograms are updated where things happen (the middleware for
HTTP requests, `kibotos.ctrl.live.placement_loop` for placements, SQLAlchemy session events for
store transactions); gauges are computed at scrape time by
`kibotos.ctrl.api.cluster_metrics` from the in-memory index and a bounded, cached store
read.  The metric names and labels are documented in docs/metrics.md.

Label values are kept to bounded sets, so a scanner probing random paths or methods
cannot grow the number of series: the route label is the route *template*
(``/v1/workspaces/{workspace_id}``), ``unmatched`` for a path no route has, and a
method outside the usual ones is ``other``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlalchemy.orm import Session

ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]],
                    Callable[[MutableMapping[str, Any]], Awaitable[None]]], Awaitable[None]]

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
UNMATCHED = "unmatched"
#: Request latency buckets: most API calls answer in milliseconds, a create waits for
#: the node's answer, a ``wait_s`` get up to 60 s, an export up to hours.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 300.0)
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 2.5, 5.0)
_TXN_START = "kibotos.metrics.txn_start"


class CtrlMetrics:
    """The counters of one ctrl (see the module docstring)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kibotos_ctrl_http_requests", "HTTP API requests answered, by route template, "
            "method and status", ["route", "method", "status"], registry=r)
        self.latency = Histogram(
            "kibotos_ctrl_http_request_duration_seconds",
            "Time from a request's arrival to the end of its answer, by route template "
            "and method", ["route", "method"], buckets=LATENCY_BUCKETS, registry=r)
        self.placements = Counter(
            "kibotos_ctrl_placements", "Placements of creates and starts, by outcome "
            "(placed, or the error code of the refusal)", ["operation", "outcome"],
            registry=r)
        self.node_answers = Counter(
            "kibotos_ctrl_placement_node_answers",
            "Answers of nodes asked to take an Instance during placement",
            ["answer"], registry=r)
        self.store_txn = Histogram(
            "kibotos_ctrl_store_transaction_seconds",
            "Store transactions from begin to commit or rollback (a group commit counts "
            "once)", ["outcome"], buckets=STORE_BUCKETS, registry=r)
        self.store_read_failures = Counter(
            "kibotos_ctrl_metrics_store_read_failures",
            "Scrapes whose store read failed (store-derived gauges are then stale)",
            registry=r)
        self.info = Gauge("kibotos_ctrl_build_info", "The running ctrl's release",
                          ["version"], registry=r)
        from kibotos import __version__

        self.info.labels(__version__).set(1)
        #: The scrape-time gauges' cache (`metrics_cluster.install`), once per ctrl.
        self.store_gauges: Any = None

    # ------------------------------------------------------------------ updates

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        method = method if method in METHODS else "other"
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, method).observe(seconds)

    def placement(self, operation: str, outcome: str) -> None:
        self.placements.labels(operation, outcome).inc()

    def node_answer(self, answer: str) -> None:
        self.node_answers.labels(answer).inc()

    def watch_store(self, listen: Callable[[str, Callable[..., Any]], None]) -> None:
        """Time every transaction of one store (`Store.listen`: its sessions only).
        The events fire in the worker thread that runs the transaction; the
        histogram is thread safe."""
        histogram = self.store_txn

        def begun(session: Session, _transaction: Any, _connection: Any) -> None:
            session.info.setdefault(_TXN_START, time.perf_counter())

        def ended(outcome: str) -> Callable[[Session], None]:
            def end(session: Session) -> None:
                started = session.info.pop(_TXN_START, None)
                if started is not None:
                    histogram.labels(outcome).observe(time.perf_counter() - started)
            return end

        listen("after_begin", begun)
        listen("after_commit", ended("commit"))
        listen("after_rollback", ended("rollback"))


class RequestMetrics:
    """Pure ASGI middleware: counts and times every HTTP request by route template.

    Starlette's router puts the matched route in ``scope["route"]`` (the same dict
    this middleware holds), so the template is read after the app ran; an exception
    that escapes the app (answered 500 by Starlette's outermost handler) counts as
    500.  WebSocket connections (the node sessions) are not requests and are not
    counted here."""

    def __init__(self, app: ASGIApp, metrics: CtrlMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: MutableMapping[str, Any],
                       receive: Callable[[], Awaitable[Any]],
                       send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_status(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None)
            self.metrics.observe_request(route if isinstance(route, str) else UNMATCHED,
                                         str(scope.get("method", "")), status,
                                         time.perf_counter() - started)
