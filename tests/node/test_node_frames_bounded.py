"""What the node reports stays inside the protocol's bounds even when an error message
does not: a reason longer than `MAX_REASON` is cut, so the hello and report that list
the Instance stay valid (an invalid hello would keep the node from connecting)."""

from __future__ import annotations

from kibotos.node.instances.contract import FAILED, Holdings, InstanceSummary
from kibotos.protocol import Hello, ReportFields
from kibotos.protocol.values import MAX_REASON


def test_a_long_reason_is_cut_and_the_report_stays_valid() -> None:
    summary = InstanceSummary("inst-1", "ws-1", FAILED, "boot failed: " + "x" * 10_000)
    wire = Holdings(instances=(summary,)).to_wire()
    assert len(wire["instances"][0]["reason"]) == MAX_REASON
    report = ReportFields.model_validate({**wire, "memory_tight": False})
    Hello(node_id="node-a", incarnation=1, resources={"cpu_millis": 1000,
                                                      "memory_bytes": 1 << 30},
          report=report)
