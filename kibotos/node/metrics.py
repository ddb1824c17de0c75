"""The node's Prometheus ``/metrics``: one scrape target per node, data plane included.

Off unless ``[node] metrics_listen`` is set (several nodes share a host in tests and
dev clusters, so no fixed default port could be right; docs/metrics.md).  The node's
own gauges are computed at scrape time from what the running parts already hold (the
Instance manager, the latest host-usage sample, the pool monitor, the control
session's status); nothing is read from disk or the network for them.  Fencings by the
holder check are counted by following the manager's ``instance_state`` feed (a FAILED
frame whose reason says the use right was taken over, once per Instance).  The data
plane's metrics are fetched over its control socket by the node's
`DataplaneSupervisor.metrics_text`, which sums every generation (counters of exited
data-plane processes stay in the sum, so they never decrease: the spec's rule), and
are appended to the node's text.  A registry of its own per node, never the global
one, so tests can run several nodes in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from kibotos.core import atomicfile
from kibotos.core.logs import EventLogger
from kibotos.node.host.usage import UsageSampler
from kibotos.node.instances.contract import InstanceManager
from kibotos.node.session.control import SessionStatus
from kibotos.node.storage.holder_watch import TAKEN_OVER

log = EventLogger()

INSTANCE_STATES = ("CREATING", "RUNNING", "STOPPING", "STOPPED", "FAILED", "DESTROYED")
#: How long a scrape waits for the data plane's answer before leaving it out.
DATAPLANE_TIMEOUT = 5.0
ADDRESS_FILE = "metrics-address"


class DataplaneText:
    """What the node needs of `DataplaneSupervisor` here."""

    async def metrics_text(self) -> str:  # pragma: no cover - protocol
        raise NotImplementedError


@dataclass
class NodeParts:
    """The running node's parts the gauges read (built by `serve_node`)."""

    manager: InstanceManager
    sampler: UsageSampler
    session: SessionStatus
    pools: Callable[[], list[dict[str, Any]]]
    dataplane: DataplaneText | Any | None = None
    #: The end of the data plane's certificate (Unix seconds; None: none yet), with TLS.
    dataplane_certificate: Callable[[], float | None] | None = None


class NodeMetrics(Collector):
    """The node's registry: scrape-time gauges plus the fencing counter."""

    def __init__(self, parts: NodeParts) -> None:
        self.parts = parts
        self.registry = CollectorRegistry(auto_describe=True)
        self.fencings = Counter(
            "kibotos_node_fencings", "Instances the holder check stopped because their "
            "use right was taken over (since the node started)", registry=self.registry)
        self._fenced: set[str] = set()
        self._dataplane_up: float | None = None
        self.registry.register(self)

    def describe(self) -> list[Any]:
        return []  # computed at scrape time

    # ------------------------------------------------------------------ fencings

    def count_frame(self, frame: Mapping[str, Any]) -> None:
        reason = frame.get("reason")
        instance_id = str(frame.get("instance_id"))
        if frame.get("state") == "FAILED" and isinstance(reason, str) \
                and reason.startswith(TAKEN_OVER) and instance_id not in self._fenced:
            self._fenced.add(instance_id)
            self.fencings.inc()

    async def follow(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                     ) -> None:
        """Count fencings from the manager's feed (its kept frames first)."""
        feed = self.parts.manager.state_feed()
        seen = 0
        task_status.started()
        while True:
            seen, frames = await feed.after(seen)
            for frame in frames:
                self.count_frame(frame)

    # ------------------------------------------------------------------ scrape

    async def text(self) -> bytes:
        """The node's text and, when it runs one, the data plane's summed text."""
        extra = b""
        dataplane = self.parts.dataplane
        if dataplane is not None:
            self._dataplane_up = 0.0
            with trio.move_on_after(DATAPLANE_TIMEOUT):
                try:
                    extra = (await dataplane.metrics_text()).encode()
                    self._dataplane_up = 1.0
                except Exception as exc:
                    log.warning("metrics: data plane metrics not read", error=str(exc))
        return generate_latest(self.registry) + extra

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        parts = self.parts
        holdings = parts.manager.holdings()
        by_state = dict.fromkeys(INSTANCE_STATES, 0)
        for summary in holdings.instances:
            by_state[summary.state] = by_state.get(summary.state, 0) + 1
        yield _gauge("kibotos_node_instances", "Instances on this node by state",
                     {("state", s): n for s, n in by_state.items()})
        yield _gauge("kibotos_node_allocated_cpu_millis", "CPU of the Instances that hold "
                     "resources", {(): holdings.allocated_cpu_millis})
        yield _gauge("kibotos_node_allocated_memory_bytes", "Memory of the Instances that "
                     "hold resources", {(): holdings.allocated_memory_bytes})
        yield _gauge("kibotos_node_objects_held", "Pool objects (layers, Volumes) this "
                     "node holds", {(): holdings.volume_count})
        sample = parts.sampler.latest
        if sample is not None:
            for name, text, value in (
                    ("vm_cpu_cores", "CPU the VMs use, in cores", sample.vm_cpu_cores),
                    ("vm_memory_bytes", "Memory the VMs use", sample.vm_memory_bytes),
                    ("memory_available_bytes", "Host MemAvailable",
                     sample.memory_available_bytes),
                    ("memory_total_bytes", "Host MemTotal", sample.memory_total_bytes),
                    ("cpu_idle_ratio", "Host CPU idle share since the previous sample",
                     sample.cpu_idle_ratio)):
                if value is not None:
                    yield _gauge(f"kibotos_node_{name}", text, {(): value})
            yield _gauge("kibotos_node_memory_tight", "1 while host memory is tight (the "
                         "node refuses creates)", {(): 1 if sample.memory_tight else 0})
            for kind, pressure in (("cpu", sample.cpu_pressure),
                                   ("memory", sample.memory_pressure)):
                if pressure is None:
                    continue
                values: dict[tuple[str, ...], float] = {("kind", "some"): pressure.some}
                if pressure.full is not None:
                    values[("kind", "full")] = pressure.full
                yield _gauge(f"kibotos_node_{kind}_pressure_ratio",
                             f"PSI {kind} avg60 as a share", values)
        yield _gauge("kibotos_node_pool_available", "1 when the pool is usable now",
                     {("pool_id", str(p.get("id"))): 1 if p.get("available") else 0
                      for p in parts.pools()})
        yield _gauge("kibotos_node_session_connected", "1 while the control session with "
                     "ctrl is established", {(): 1 if parts.session.connected else 0})
        established = CounterMetricFamily(
            "kibotos_node_sessions_established", "Control sessions established since "
            "the node started")
        established.add_metric([], parts.session.established)
        yield established
        gauges = parts.manager.gauges()
        if gauges.drain_requested is not None:
            yield _gauge("kibotos_node_drain_requested", "1 while ctrl asks the node to "
                         "refuse creates", {(): 1 if gauges.drain_requested else 0})
        if gauges.adoption_counts is not None:
            yield _gauge("kibotos_node_start_adoptions", "What this node start did with "
                         "the Instances it found, by verdict",
                         {("action", a): n for a, n in sorted(gauges.adoption_counts.items())})
        if gauges.cleanup_pending is not None:
            yield _gauge("kibotos_node_cleanup_pending", "Instances whose release is stuck "
                         "(processes left after the unit's stop), retried every 5 s",
                         {(): gauges.cleanup_pending})
        expiry = parts.dataplane_certificate() if parts.dataplane_certificate else None
        if expiry is not None:
            yield _gauge("kibotos_node_dataplane_certificate_expiry_seconds", "When the "
                         "data plane's certificate expires (Unix time); the node renews "
                         "it at two thirds of its lifetime", {(): expiry})
        if self._dataplane_up is not None:
            yield _gauge("kibotos_node_dataplane_metrics_up", "1 when this scrape read the "
                         "data plane's metrics", {(): self._dataplane_up})


def _gauge(name: str, text: str, values: Mapping[tuple[str, ...], float]
           ) -> GaugeMetricFamily:
    """A gauge family from {(label, value) or (): number}; one label at most."""
    labels = sorted({key[0] for key in values if key})
    family = GaugeMetricFamily(name, text, labels=labels)
    for key, value in values.items():
        family.add_metric([key[1]] if key else [], value)
    return family


def metrics_app(metrics: NodeMetrics) -> Starlette:
    async def endpoint(request: Request) -> Response:
        return Response(await metrics.text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def not_found(request: Request, exc: Exception) -> Response:
        return PlainTextResponse("only /metrics is served here\n", status_code=404)

    return Starlette(routes=[Route("/metrics", endpoint, methods=["GET"])],
                     exception_handlers={404: not_found})


async def serve_metrics(metrics: NodeMetrics, listen: str, runtime_dir: Path, *,
                        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
                        ) -> None:
    """Serve ``/metrics`` on `listen` until cancelled; ``started(host:port)`` once
    bound, the address also written to ``<runtime_dir>/metrics-address`` (``listen``
    may use port 0) and removed at the end."""
    config = HypercornConfig()
    config.bind = [listen]
    config.accesslog = None
    config.graceful_timeout = 1.0
    address_file = runtime_dir / ADDRESS_FILE
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(metrics.follow)
            binds: list[str] = await nursery.start(
                hypercorn_serve, metrics_app(metrics), config)
            address = binds[0].split("://", 1)[-1]
            atomicfile.write_bytes(address_file, (address + "\n").encode())
            log.info("metrics listening", address=address)
            task_status.started(address)
    finally:
        address_file.unlink(missing_ok=True)
