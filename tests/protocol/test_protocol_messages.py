"""The session's frames: what the node and ctrl send today is accepted, each known field
is checked strictly and named when wrong, unknown fields are ignored (a newer peer may
add one), and every frame built from its class encodes to what the other side parses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kibotos import protocol as p

NOW = "2026-01-01T00:00:00.000Z"
REPORT = {"allocated": {"cpu_millis": 1500, "memory_bytes": 256 << 20},
          "instance_count": 1, "volume_count": 2, "memory_tight": True,
          "memory_tight_since": "2026-01-01T00:00:00+00:00",
          "instances": [{"instance_id": "inst-1", "workspace_id": "ws-1", "state": "RUNNING",
                         "reason": None,
                         "objects": [{"kind": "retained-layers", "pool_id": "pool-a",
                                      "object_id": "lay-1", "epoch": 1,
                                      "released_cleanly": None}]}]}
HELLO = {"type": "hello", "node_id": "node-a", "incarnation": 3,
         "release_version": "unreleased", "source_revision": "abc123",
         "resources": {"cpu_millis": 4000, "memory_bytes": 8 << 30}, "report": REPORT,
         "dataplane_address": "127.0.0.1:7500",
         "facts": {"pools": [{"id": "pool-a", "shared": False, "default": True}]}}
STATE = {"type": "instance_state", "instance_id": "inst-1", "workspace_id": "ws-1",
         "state": "STOPPING", "reason": None, "at": NOW,
         "guest": {"boot_id": "b-1", "capabilities": ["exec"], "responding": False,
                   "agent_version": "1.0"},
         "cleanup": {"pending_since": NOW,
                     "held": [{"item": "RUNTIME", "part": "process 12 is left"}]},
         "objects": [{"kind": "volumes", "pool_id": "pool-a", "object_id": "vol-1",
                      "epoch": 2, "released_cleanly": True}]}

#: One valid frame of every type, as the two sides send them today.
FRAMES: dict[str, dict[str, Any]] = {
    "hello": HELLO,
    "report": {"type": "report", **REPORT, "facts": {"pools": []}},
    "instance_state": STATE,
    "clock_reply": {"type": "clock_reply", "id": 3, "node_time": 1767225600.123,
                    "sync_status": "synchronized"},
    "usage": {"type": "usage", "id": 4, "sample": {"at": NOW, "vm_cpu_cores": None}},
    "command_result": {"type": "command_result", "id": 5, "ok": False,
                       "error": {"code": "not_found", "message": "no such Instance"}},
    "overcommit_ack": {"type": "overcommit_ack", "serial": 2},
    "ping": {"type": "ping"},
    "welcome": {"type": "welcome", "session_id": "ses-01k6", "drain_requested": False,
                "overcommit": {"cpu": "1", "memory": "1.5", "serial": 2},
                "session_signing_public_key": "ed25519:abc"},
    "rejected": {"type": "rejected", "reason": "stale_incarnation",
                 "message": "incarnation 2 < 3"},
    "close": {"type": "close", "reason": "replaced"},
    "clock_probe": {"type": "clock_probe", "id": 1},
    "usage_request": {"type": "usage_request", "id": 2},
    "overcommit": {"type": "overcommit", "cpu": "2", "memory": "1", "serial": 7},
    "command": {"type": "command", "id": 9, "kind": "instance.destroy",
                "args": {"instance_id": "inst-1"}},
    "pong": {"type": "pong"},
}


def model(kind: str) -> type[p.Message]:
    return {**p.NODE_MESSAGES, **p.CTRL_MESSAGES}[kind]


def refused(kind: str, frame: dict[str, Any]) -> str:
    with pytest.raises(p.ProtocolError) as info:
        p.parse(model(kind), frame)
    text = str(info.value)
    assert text.startswith(f"invalid {frame.get('type')} message: ")
    return text


def test_every_message_type_has_an_example_and_one_direction() -> None:
    assert set(p.NODE_MESSAGES).isdisjoint(p.CTRL_MESSAGES)
    assert set(FRAMES) == set(p.NODE_MESSAGES) | set(p.CTRL_MESSAGES)
    for kind, cls in {**p.NODE_MESSAGES, **p.CTRL_MESSAGES}.items():
        assert cls.type_name() == kind


@pytest.mark.parametrize("kind", sorted(FRAMES))
def test_today_s_frames_parse_and_encode_back(kind: str) -> None:
    parsed = p.parse(model(kind), FRAMES[kind])
    assert json.loads(p.encode(parsed)) == FRAMES[kind]
    assert p.decode(p.encode(parsed)) == FRAMES[kind]


@pytest.mark.parametrize("kind", sorted(FRAMES))
def test_unknown_fields_are_ignored(kind: str) -> None:
    parsed = p.parse(model(kind), {**FRAMES[kind], "added_by_a_newer_peer": [1, 2]})
    assert "added_by_a_newer_peer" not in parsed.to_wire()


def test_a_frame_of_another_type_is_refused() -> None:
    assert "type: Input should be 'ping'" in refused("ping", {"type": "pong"})


def test_built_frames_carry_their_type_first() -> None:
    assert p.encode(p.Ping()) == '{"type":"ping"}'
    frame = p.Close(reason=p.CloseReason.REVOKED).to_wire()
    assert list(frame) == ["type", "reason"]
    assert frame["reason"] == "revoked"
    welcome = p.Welcome(session_id="ses-1").to_wire()
    assert welcome == {"type": "welcome", "session_id": "ses-1"}  # unset stays out


@pytest.mark.parametrize(("kind", "change", "words"), [
    ("hello", {"node_id": "Node-A"}, "node_id: invalid node ID 'Node-A'"),
    ("hello", {"incarnation": 0}, "incarnation: Input should be greater than or equal to 1"),
    ("hello", {"incarnation": "3"}, "incarnation: Input should be a valid integer"),
    ("hello", {"resources": {"cpu_millis": 1}}, "resources.memory_bytes: Field required"),
    ("hello", {"release_version": "v" * 65}, "release_version: String should have at most"),
    ("report", {"memory_tight": 1}, "memory_tight: Input should be a valid boolean"),
    ("report", {"memory_tight_since": "soon"}, "memory_tight_since: 'soon' is not an RFC"),
    ("report", {"instance_count": -1}, "instance_count: Input should be greater"),
    ("report", {"instances": [{"instance_id": "inst-1", "workspace_id": "ws-1",
                               "state": "running"}]}, "instances.0.state: Input should be"),
    ("report", {"allocated": {"cpu_millis": 0, "memory_bytes": 1 << 60}},
     "allocated.memory_bytes: Input should be less than or equal"),
    ("instance_state", {"state": "GONE"}, "state: Input should be 'CREATING'"),
    ("instance_state", {"instance_id": "../x"}, "instance_id: invalid instance ID"),
    ("instance_state", {"at": "2026-01-01T00:00:00"}, "at: '2026-01-01T00:00:00' has no"),
    ("instance_state", {"objects": [{"kind": "volume", "pool_id": "pool-a",
                                     "object_id": "v", "epoch": 1}]},
     "objects.0.kind: Input should be 'retained-layers' or 'volumes'"),
    ("instance_state", {"cleanup": {"held": []}}, "cleanup.pending_since: Field required"),
    ("instance_state", {"guest": {"capabilities": "exec"}},
     "guest.capabilities: Input should be a valid list"),
    ("clock_reply", {"node_time": "now"}, "node_time: Input should be a valid number"),
    ("clock_reply", {"sync_status": "maybe"}, "sync_status: Input should be 'synchronized'"),
    ("command_result", {"ok": "false"}, "ok: Input should be a valid boolean"),
    ("command_result", {"id": 0}, "id: Input should be greater than or equal to 1"),
    ("command_result", {"error": {"message": "x"}}, "error.code: Field required"),
    ("overcommit_ack", {"serial": True}, "serial: Input should be a valid integer"),
    ("welcome", {"session_id": 5}, "session_id: Input should be a valid string"),
    ("welcome", {"overcommit": {"cpu": "17", "memory": "1", "serial": 1}},
     "overcommit.cpu: ratio 17 is out of range"),
    ("welcome", {"drain_requested": "no"}, "drain_requested: Input should be a valid bool"),
    ("rejected", {"reason": "banned"}, "reason: Input should be 'isolated'"),
    ("close", {"reason": None}, "reason: Input should be 'revoked'"),
    ("overcommit", {"memory": 1}, "memory: Input should be a valid string"),
    ("command", {"args": []}, "args: Input should be a valid dictionary"),
    ("command", {"kind": ""}, "kind: String should have at least 1 character"),
])
def test_known_fields_are_checked_and_named(kind: str, change: dict[str, Any],
                                            words: str) -> None:
    text = refused(kind, {**FRAMES[kind], **change})
    assert words in text, text


def test_a_non_finite_node_time_is_refused() -> None:
    assert "node_time: Input should be a finite number" in refused(
        "clock_reply", {**FRAMES["clock_reply"], "node_time": float("nan")})


def test_guest_facts_keep_fields_ctrl_does_not_know() -> None:
    frame = p.parse(p.InstanceState, STATE)
    assert frame.guest is not None
    assert frame.guest.to_wire()["agent_version"] == "1.0"


def test_the_defaults_of_an_old_node_s_frames() -> None:
    hello = p.parse(p.Hello, {"type": "hello", "node_id": "node-a", "incarnation": 1,
                              "resources": {"cpu_millis": 1000, "memory_bytes": 1 << 30}})
    assert hello.report.instances is None
    assert hello.facts == {}
    assert hello.report.allocated == p.Amount(cpu_millis=0, memory_bytes=0)
    state = p.parse(p.InstanceState, {"type": "instance_state", "instance_id": "inst-1",
                                      "state": "RUNNING"})
    assert state.objects is None
    assert state.state is p.InstanceStatus.RUNNING
    assert state.state == "RUNNING"  # a StrEnum is its wire text
    welcome = p.parse(p.Welcome, {"type": "welcome", "session_id": "ses-1"})
    assert welcome.overcommit is None
    assert welcome.drain_requested is None
    rejected = p.parse(p.Rejected, {"type": "rejected", "reason": "isolated"})
    assert rejected.message == ""


@pytest.mark.parametrize(("text", "words"), [
    ("{", "frame is not JSON"), ("[1]", "not a JSON object with a string 'type'"),
    ('{"type": 1}', "not a JSON object with a string 'type'"), (b"\xff", "not JSON")])
def test_decode_refuses_what_is_not_a_frame(text: str | bytes, words: str) -> None:
    with pytest.raises(p.ProtocolError, match=words):
        p.decode(text)


def test_guest_facts_from_an_untrusted_guest_keep_what_fits() -> None:
    facts = p.GuestFacts.from_guest({
        "boot_id": 5, "capabilities": ["exec", 3, "x" * 200, "a\x1bb",
                                       *(f"c{i}" for i in range(300))],
        "responding": "yes", "agent_version": "v" * 500, "protocol_version": 1,
        "nested": {"a": 1}, "kernel": "6.1\x1b[2J\n"})
    wire = facts.to_wire()
    assert "boot_id" not in wire  # a number is no boot ID
    assert "responding" not in wire
    assert wire["capabilities"][0] == "exec"
    assert len(wire["capabilities"]) == 256
    assert wire["agent_version"] == "v" * 128
    assert "a\x1bb" not in wire["capabilities"]  # a capability with a control character
    assert wire["kernel"] == "6.1\\x1b[2J\\x0a"  # a text: escaped, not refused
    assert wire["protocol_version"] == 1
    assert "nested" not in wire
    # and the frame that carries it is valid
    frame = p.parse(p.InstanceState, {**STATE, "state": "RUNNING", "guest": wire})
    assert frame.guest == facts
