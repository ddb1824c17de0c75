"""The data plane's counters, and how the node sums them over every generation.

Each data-plane process counts in its own registry (prometheus-client) and hands the
text out on its control socket (``{"type": "metrics"}``).  The node's ``/metrics`` sums
the processes: the spec says counters never decrease, even after a process exits, so
`MetricsSum` keeps the last values it read from each generation and adds them up,
the dead generations' included.  Gauges are summed over live processes only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

LabelKey = tuple[tuple[str, str], ...]
SampleKey = tuple[str, LabelKey]


class DataplaneMetrics:
    """The counters of one data-plane process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.connections = Counter(
            "kibotos_dataplane_connections", "Data-plane connections accepted, by operation",
            ["operation"], registry=r)
        self.rejected = Counter(
            "kibotos_dataplane_connections_rejected",
            "Data-plane connections refused before the upgrade, by error code",
            ["code"], registry=r)
        self.exec_started = Counter(
            "kibotos_dataplane_exec_started", "Processes started in guests by exec",
            registry=r)
        self.exec_failed = Counter(
            "kibotos_dataplane_exec_failed",
            "exec requests that did not start a process, by error code", ["code"],
            registry=r)
        self.bytes = Counter(
            "kibotos_dataplane_exec_bytes", "Bytes relayed by exec, by stream", ["stream"],
            registry=r)
        self.hung_up = Counter(
            "kibotos_dataplane_exec_hung_up",
            "exec connections that dropped before their process exited", registry=r)
        self.files_requests = Counter(
            "kibotos_dataplane_files_requests",
            "File requests served, by request and outcome (ok or the error code)",
            ["request", "outcome"], registry=r)
        self.files_bytes = Counter(
            "kibotos_dataplane_files_bytes", "File bytes relayed, by direction",
            ["direction"], registry=r)
        self.ports_bytes = Counter(
            "kibotos_dataplane_ports_bytes", "Port-forward bytes relayed, by direction",
            ["direction"], registry=r)
        self.ports_connect_failed = Counter(
            "kibotos_dataplane_ports_connect_failed",
            "Port-forward connections the guest could not open, by reason "
            "(connection_refused, timeout, failed)", ["reason"], registry=r)
        self.ports_closed = Counter(
            "kibotos_dataplane_ports_closed",
            "Port-forward connections ended, by outcome (ended, guest_failed, "
            "client_gone, protocol, stopping)", ["outcome"], registry=r)
        self.closed_on_stop = Counter(
            "kibotos_dataplane_connections_closed_on_stop",
            "Connections still open when the drain period of a stop ended", registry=r)
        self.state_updates = Counter(
            "kibotos_dataplane_state_updates", "States the node handed over", registry=r)
        self.active = Gauge(
            "kibotos_dataplane_connections_active", "Data-plane connections open now",
            registry=r)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def parse_samples(text: str) -> tuple[dict[SampleKey, float], dict[SampleKey, float]]:
    """(counters, gauges) of a Prometheus text, keyed by sample name and sorted labels.
    Counter samples keep their ``_total`` name; ``_created`` samples are dropped (a sum
    of creation times means nothing)."""
    counters: dict[SampleKey, float] = {}
    gauges: dict[SampleKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            key = (sample.name, tuple(sorted(sample.labels.items())))
            if family.type == "counter":
                counters[key] = float(sample.value)
            elif family.type == "gauge":
                gauges[key] = float(sample.value)
    return counters, gauges


@dataclass
class MetricsSum:
    """Last values read from each generation; `render` gives the node's sum."""

    counters: dict[int, dict[SampleKey, float]] = field(default_factory=dict)
    gauges: dict[int, dict[SampleKey, float]] = field(default_factory=dict)

    def update(self, generation: int, text: str) -> None:
        counters, gauges = parse_samples(text)
        previous = self.counters.get(generation, {})
        # A counter that went down means the text came from a restarted process under
        # the same generation number, which the node never does; keep the larger value
        # so the sum still never decreases.
        self.counters[generation] = {k: max(v, previous.get(k, 0.0))
                                     for k, v in {**previous, **counters}.items()}
        self.gauges[generation] = gauges

    def exited(self, generation: int) -> None:
        """The process is gone: its counters stay in the sum, its gauges leave it."""
        self.gauges.pop(generation, None)

    def totals(self) -> tuple[dict[SampleKey, float], dict[SampleKey, float]]:
        return _sum(self.counters.values()), _sum(self.gauges.values())

    def render(self) -> str:
        """The summed samples in the Prometheus text format, for the node's ``/metrics``."""
        counters, gauges = self.totals()
        lines: list[str] = []
        for kind, values in (("counter", counters), ("gauge", gauges)):
            typed: set[str] = set()
            for (name, labels), value in sorted(values.items()):
                family = name.removesuffix("_total") if kind == "counter" else name
                if family not in typed:
                    typed.add(family)
                    lines.append(f"# TYPE {family} {kind}")
                label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
                lines.append(f"{name}{{{label_text}}} {value:g}" if labels
                             else f"{name} {value:g}")
        return "\n".join(lines) + ("\n" if lines else "")


def _sum(parts: Iterable[dict[SampleKey, float]]) -> dict[SampleKey, float]:
    total: dict[SampleKey, float] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return total


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
