"""The network fact of ``hello``/``report`` (`NetworkFacts`) and the guest addresses of
``instance_state``: optional, so frames of nodes from before networking still parse;
checked when present."""

from __future__ import annotations

from typing import Any

import pytest

from kibotos.protocol import Hello, InstanceState, ProtocolError, Report, parse

HELLO: dict[str, Any] = {"type": "hello", "node_id": "node-a", "incarnation": 1,
                         "resources": {"cpu_millis": 1000, "memory_bytes": 1 << 30}}


def test_a_hello_without_a_network_fact_still_parses() -> None:
    hello = parse(Hello, {**HELLO, "facts": {"pools": [{"id": "p"}]}})
    assert "network" not in hello.facts
    assert parse(Hello, {**HELLO, "facts": {"network": None}}).facts == {"network": None}


@pytest.mark.parametrize(("fact", "kept"), [
    ({"public_egress": True}, {"public_egress": True}),
    ({}, {"public_egress": False}),
    ({"public_egress": False, "newer": 1}, {"public_egress": False}),
])
def test_the_network_fact_is_kept_in_full_form(fact: dict[str, Any],
                                               kept: dict[str, Any]) -> None:
    assert parse(Hello, {**HELLO, "facts": {"network": fact}}).facts["network"] == kept
    report = parse(Report, {"type": "report", "facts": {"network": fact}})
    assert report.facts is not None
    assert report.facts["network"] == kept


@pytest.mark.parametrize("fact", [{"public_egress": "yes"}, {"public_egress": 1}, "on", [1]])
def test_a_bad_network_fact_names_the_field(fact: object) -> None:
    with pytest.raises(ProtocolError) as info:
        parse(Hello, {**HELLO, "facts": {"network": fact}})
    assert "facts: network" in str(info.value)


def test_guest_addresses_are_optional_and_canonical() -> None:
    frame = {"type": "instance_state", "instance_id": "inst-1", "state": "RUNNING"}
    assert parse(InstanceState, frame).addresses is None
    got = parse(InstanceState, {**frame, "addresses": ["10.200.0.3/31", "fd00:0::3/127"]})
    assert got.addresses == ["10.200.0.3/31", "fd00::3/127"]
    for bad in (["10.200.0.3/33"], ["nope"], [3], ["10.0.0.1/32"] * 17):
        with pytest.raises(ProtocolError, match="addresses"):
            parse(InstanceState, {**frame, "addresses": bad})
