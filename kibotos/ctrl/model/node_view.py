"""The ``Node`` JSON of the API: the registration record plus what ctrl derives from it.

One function renders it for list, get, every node write and the command journal, so a
replayed write returns exactly the shape a fresh one does.  Field meanings are in
docs/architecture.md ("Node (JSON) fields").
"""

from __future__ import annotations

from typing import Any

from kibotos.core.units import format_ratio
from kibotos.ctrl.model import nodes, overcommit
from kibotos.ctrl.model.nodes import NodeFacts
from kibotos.ctrl.wire.base import iso


def _session(node: NodeFacts) -> dict[str, Any] | None:
    if node.incarnation is None:
        return None
    clock = None
    if node.clock_measured_at is not None and node.clock_offset_ms is not None:
        clock = {
            "offset_ms": node.clock_offset_ms,
            "uncertainty_ms": node.clock_uncertainty_ms or 0.0,
            "sync_status": node.clock_sync_status,
            "measured_at": iso(node.clock_measured_at),
            "over": nodes.clock_over(node),
        }
    return {
        "incarnation": node.incarnation,
        "session_id": node.session_id,
        "release_version": node.release_version,
        "source_revision": node.source_revision,
        "alive": node.session_alive,
        "started_at": iso(node.session_started_at),
        "ended_at": iso(node.session_ended_at),
        "clock": clock,
    }


def _report(node: NodeFacts) -> dict[str, Any] | None:
    if node.report_at is None:
        return None
    return {
        "at": iso(node.report_at),
        "allocated": {"cpu_millis": node.allocated_cpu_millis,
                      "memory_bytes": node.allocated_memory_bytes},
        "instance_count": node.instance_count,
        "volume_count": node.volume_count,
    }


def node_json(node: NodeFacts, default: overcommit.DefaultRatios, *,
              with_usage: bool = False) -> dict[str, Any]:
    """Render one node.  `host_usage` (get only) is the latest sample, shown only while
    the control session is alive: an old sample of a dead node would mislead."""
    cpu, cpu_src, mem, mem_src = overcommit.effective(node, default)
    sched_cpu, sched_mem = overcommit.schedulable(node, default)
    ok, reason = nodes.placeable(node)
    out: dict[str, Any] = {
        "node_id": node.node_id,
        "admission": node.admission,
        "drain_requested": node.drain_requested,
        "isolated": node.isolated_incarnation is not None,
        "isolated_incarnation": node.isolated_incarnation,
        "retired": node.retired_at is not None,
        "retired_at": iso(node.retired_at),
        "status": nodes.status(node),
        "registration_version": node.registration_version,
        "latest_session": _session(node),
        "latest_report": _report(node),
        "resources": {"cpu_millis": node.resources_cpu_millis,
                      "memory_bytes": node.resources_memory_bytes},
        "schedulable": {"cpu_millis": sched_cpu, "memory_bytes": sched_mem},
        "overcommit": {
            "cpu": {"ratio": format_ratio(cpu), "source": cpu_src},
            "memory": {"ratio": format_ratio(mem), "source": mem_src},
            "confirmed": nodes.overcommit_confirmed(node),
        },
        "memory_tight": node.memory_tight,
        "memory_tight_since": iso(node.memory_tight_since),
        "dataplane_address": node.dataplane_address,
        "placement": {"eligible": ok, "reason": reason},
    }
    if with_usage:
        out["host_usage"] = node.host_usage if node.session_alive else None
    return out
