"""Derived status and placement admission, as pure functions of the registration record."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from kibotos.ctrl.model import nodes
from kibotos.ctrl.store.models import Node

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def placeable_node(**fields: object) -> Node:
    node = nodes.new_node("node-a", NOW)
    node.session_alive = True
    node.incarnation = 1
    node.session_started_at = NOW
    node.clock_offset_ms = 10.0
    node.clock_uncertainty_ms = 1.0
    node.clock_measured_at = NOW + timedelta(seconds=1)
    for name, value in fields.items():
        setattr(node, name, value)
    return node


def test_a_healthy_node_is_placeable() -> None:
    assert nodes.placeable(placeable_node()) == (True, None)
    assert nodes.status(placeable_node()) == "READY"


@pytest.mark.parametrize(("fields", "reason"), [
    ({"retired_at": NOW}, "retired"),
    ({"admission": "revoked"}, "not admitted (identity revoked)"),
    ({"isolated_incarnation": 1}, "isolated"),
    ({"drain_requested": True}, "drain requested"),
    ({"session_alive": False}, "no live control session"),
    ({"clock_measured_at": None}, "clock not measured in this session yet"),
    ({"clock_measured_at": NOW - timedelta(seconds=1)},
     "clock not measured in this session yet"),
    ({"clock_offset_ms": 30_002.0, "clock_uncertainty_ms": 1.0}, "clock offset beyond 30 s"),
    ({"clock_offset_ms": -40_000.0}, "clock offset beyond 30 s"),
    ({"memory_tight": True}, "host memory tight"),
    ({"overcommit_sent_serial": 3, "overcommit_confirmed_serial": 2},
     "overcommit change not yet confirmed by the node"),
])
def test_each_admission_rule(fields: dict[str, object], reason: str) -> None:
    assert nodes.placeable(placeable_node(**fields)) == (False, reason)


@pytest.mark.parametrize(("offset", "uncertainty", "over"), [
    (30_000.0, 0.0, False), (30_000.5, 0.0, True), (31_000.0, 1_000.0, False),
    (31_000.0, 999.0, True), (-31_000.0, 999.0, True), (None, None, False),
])
def test_clock_over(offset: float | None, uncertainty: float | None, over: bool) -> None:
    node = placeable_node(clock_offset_ms=offset, clock_uncertainty_ms=uncertainty)
    assert nodes.clock_over(node) is over


@pytest.mark.parametrize(("fields", "status"), [
    ({}, "READY"),
    ({"session_alive": False}, "OFFLINE"),
    ({"drain_requested": True}, "DRAINED"),
    ({"drain_requested": True, "instance_count": 1}, "DRAINING"),
    ({"drain_requested": True, "volume_count": 1}, "DRAINING"),
    ({"drain_requested": True, "isolated_incarnation": 1}, "ISOLATED"),
    ({"isolated_incarnation": 1, "admission": "revoked"}, "REVOKED"),
    ({"admission": "revoked", "retired_at": NOW}, "RETIRED"),
    ({"isolated_incarnation": 1, "retired_at": NOW}, "RETIRED"),
])
def test_status_precedence(fields: dict[str, object], status: str) -> None:
    assert nodes.status(placeable_node(**fields)) == status
