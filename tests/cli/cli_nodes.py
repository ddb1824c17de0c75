"""Fixed Node records in the API's JSON shape (checked against `kibotos.ctrl.wire.base`)."""

from __future__ import annotations

import copy
from typing import Any

GIB = 2**30

READY: dict[str, Any] = {
    "node_id": "node-a",
    "admission": "admitted",
    "drain_requested": False,
    "isolated": False,
    "isolated_incarnation": None,
    "retired": False,
    "retired_at": None,
    "status": "READY",
    "registration_version": 7,
    "latest_session": {
        "incarnation": 3,
        "session_id": "ses-01k6aaaaaaaaaaaaaaaaaaaaaa",
        "release_version": "0.2.0",
        "source_revision": "abc1234",
        "alive": True,
        "started_at": "2026-11-29T15:00:00.000Z",
        "ended_at": None,
        "clock": {
            "offset_ms": 12.4,
            "uncertainty_ms": 0.8,
            "sync_status": "synchronized",
            "measured_at": "2026-11-29T15:01:00.000Z",
            "over": False,
        },
    },
    "latest_report": {
        "at": "2026-11-29T15:01:00.000Z",
        "allocated": {"cpu_millis": 1500, "memory_bytes": 2 * GIB},
        "instance_count": 2,
        "volume_count": 3,
    },
    "resources": {"cpu_millis": 4000, "memory_bytes": 8 * GIB},
    "schedulable": {"cpu_millis": 10000, "memory_bytes": 8 * GIB},
    "overcommit": {
        "cpu": {"ratio": "2.5", "source": "override"},
        "memory": {"ratio": "1", "source": "default"},
        "confirmed": True,
    },
    "memory_tight": False,
    "memory_tight_since": None,
    "dataplane_address": "127.0.0.1:7500",
    "placement": {"eligible": True, "reason": None},
    "host_usage": None,
}

USAGE: dict[str, Any] = {
    "at": "2026-11-29T15:01:00.000Z",
    "vm_cpu_cores": 1.25,
    "vm_memory_bytes": 3 * GIB // 2,
    "memory_available_bytes": 4 * GIB,
    "memory_total_bytes": 16 * GIB,
    "memory_tight": False,
    "memory_tight_since": None,
    "cpu_idle_ratio": 0.725,
    "cpu_pressure": {"some": 0.012, "full": 0.0},
    "memory_pressure": {"some": 0.0, "full": 0.0},
}


def node(**changes: Any) -> dict[str, Any]:
    """READY with top-level fields replaced; nested dicts are merged one level deep."""
    value = copy.deepcopy(READY)
    for key, change in changes.items():
        if isinstance(change, dict) and isinstance(value.get(key), dict):
            value[key] = {**value[key], **change}
        else:
            value[key] = change
    return value


def offline(node_id: str = "node-b") -> dict[str, Any]:
    """A node whose session ended and that never was released: `-` everywhere it can."""
    n = node(node_id=node_id, status="OFFLINE", registration_version=12)
    n["latest_session"].update(alive=False, release_version=None,
                               ended_at="2026-11-29T15:02:00.000Z")
    n["latest_report"] = None
    return n


def over(node_id: str = "node-c") -> dict[str, Any]:
    """A live, unreleased build whose clock is 31.2 s ahead: beyond the allowed 30 s."""
    n = node(node_id=node_id, memory_tight=True,
             memory_tight_since="2026-11-29T15:00:30.000Z")
    n["latest_session"]["release_version"] = "unreleased"
    n["latest_session"]["clock"].update(offset_ms=31234.0, over=True)
    return n
