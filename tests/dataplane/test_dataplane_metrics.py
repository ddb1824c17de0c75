"""The data plane's counters and the node's sum over generations."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kibotos.dataplane.process.metrics import DataplaneMetrics, MetricsSum, parse_samples


def sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise KeyError((name, labels))


def test_counters_of_exited_generations_stay_in_the_sum() -> None:
    one, two = DataplaneMetrics(), DataplaneMetrics()
    one.exec_started.inc(3)
    one.rejected.labels("unauthenticated").inc()
    one.active.set(2)
    two.exec_started.inc(1)
    two.bytes.labels("stdout").inc(100)
    two.active.set(1)
    total = MetricsSum()
    total.update(1, one.text())
    total.update(2, two.text())
    text = total.render()
    assert sample(text, "kibotos_dataplane_exec_started_total") == 4
    assert sample(text, "kibotos_dataplane_connections_active") == 3
    total.exited(1)  # generation 1 is gone: its counts stay, its gauge goes
    text = total.render()
    assert sample(text, "kibotos_dataplane_exec_started_total") == 4
    assert sample(text, "kibotos_dataplane_connections_rejected_total",
                  code="unauthenticated") == 1
    assert sample(text, "kibotos_dataplane_exec_bytes_total", stream="stdout") == 100
    assert sample(text, "kibotos_dataplane_connections_active") == 1
    # The rendered text is valid exposition format, typed once per family.
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families["kibotos_dataplane_exec_started"] == "counter"
    assert families["kibotos_dataplane_connections_active"] == "gauge"
    assert text.count("# TYPE kibotos_dataplane_exec_started counter") == 1


def test_a_counter_never_goes_down() -> None:
    metrics = DataplaneMetrics()
    metrics.exec_started.inc(5)
    total = MetricsSum()
    total.update(7, metrics.text())
    total.update(7, DataplaneMetrics().text())  # a reading that went back to zero
    counters, _ = total.totals()
    assert counters[("kibotos_dataplane_exec_started_total", ())] == 5


def test_created_samples_are_not_summed() -> None:
    counters, gauges = parse_samples(DataplaneMetrics().text())
    assert not any(name.endswith("_created") for name, _ in counters)
    assert ("kibotos_dataplane_connections_active", ()) in gauges
