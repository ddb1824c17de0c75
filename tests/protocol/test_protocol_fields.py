"""The field types of `kibotos.protocol`: each ID type checks its `kibotos.core.ids` shape and
is strict; times, sizes, counters and ratios have one rule and a ceiling."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from kibotos.protocol import ids as pids
from kibotos.protocol import values

MIB = 1 << 20

ID_CASES: list[tuple[Any, str, list[str], list[str]]] = [
    (pids.ObjectId, "invalid object ID", ["a", "vol-1", "0" * 32], ["", "-a", "A", "a" * 33,
                                                                    "a_b", "a/b", ".."]),
    (pids.InstanceId, "invalid instance ID", ["inst-01k6"], ["Inst"]),
    (pids.WorkspaceId, "invalid workspace ID", ["ws-1"], ["ws 1"]),
    (pids.VolumeId, "invalid volume ID", ["vol-1"], ["vol.1"]),
    (pids.LayerRefId, "invalid retained layer ref", ["lay-1"], ["lay/1"]),
    (pids.SessionId, "invalid session ID", ["ses-1"], ["ses_1"]),
    (pids.NodeId, "invalid node ID", ["node-a", "n" * 63], ["node-", "n" * 64, "a.b"]),
    (pids.PoolId, "invalid pool ID", ["pool-a", "p.1"], ["pool-", ".p", "P"]),
    (pids.TemplateName, "invalid template name", ["base-1", "a.b"], ["..", ".", "a.", "A"]),
    (pids.CommandId, "invalid command ID", ["cmd/stop", "A.b:c"], ["/x", "", "a b"]),
    (pids.LabelKey, "invalid label key", ["team", "a.b/c"], ["Team", "-a"]),
    (pids.Digest, "invalid digest", [f"sha256:{'0' * 64}"], ["sha256:", "0" * 63,
                                                             f"sha512:{'0' * 64}"]),
]


@pytest.mark.parametrize(("kind", "words", "ok", "bad"), ID_CASES)
def test_id_types_check_their_shape(kind: Any, words: str, ok: list[str],
                                    bad: list[str]) -> None:
    adapter: TypeAdapter[str] = TypeAdapter(kind)
    for value in ok:
        assert adapter.validate_python(value) in (value, f"sha256:{value}")
    for value in bad:
        with pytest.raises(ValidationError, match=words):
            adapter.validate_python(value)


@pytest.mark.parametrize("kind", [case[0] for case in ID_CASES])
def test_id_types_are_strict_even_in_a_lax_model(kind: Any) -> None:
    adapter: TypeAdapter[str] = TypeAdapter(kind)
    for value in (1, 1.5, True, b"abc", None):
        with pytest.raises(ValidationError, match="valid string"):
            adapter.validate_python(value)


def test_a_bare_digest_gains_its_prefix() -> None:
    assert TypeAdapter(pids.Digest).validate_python("ab" * 32) == f"sha256:{'ab' * 32}"


def check(kind: Any, value: Any) -> Any:
    return TypeAdapter(kind).validate_python(value)


def refuse(kind: Any, value: Any, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        check(kind, value)


def test_timestamps_are_rfc3339_with_a_zone() -> None:
    for value in ("2026-01-01T00:00:00Z", "2026-01-01T00:00:00.123+00:00",
                  "2026-01-01T01:00:00+01:00"):
        assert check(values.Timestamp, value) == value
    refuse(values.Timestamp, "2026-01-01T00:00:00", "has no time zone")
    refuse(values.Timestamp, "yesterday", "is not an RFC 3339 time")
    refuse(values.Timestamp, 1767225600, "valid string")
    refuse(values.Timestamp, "2026-01-01T00:00:00Z" + " " * 60, "at most 64")


@pytest.mark.parametrize(("kind", "low", "high"), [
    (values.Epoch, 0, values.MAX_COUNTER), (values.Serial, 0, values.MAX_COUNTER),
    (values.RequestId, 1, values.MAX_COUNTER), (values.Count, 0, values.MAX_COUNT),
    (values.InstanceCpuMillis, 1, values.MAX_INSTANCE_CPU_MILLIS),
    (values.NodeCpuMillis, 0, values.MAX_NODE_CPU_MILLIS),
    (values.NodeMemory, 0, values.MAX_NODE_MEMORY),
])
def test_counters_are_bounded_and_strict(kind: Any, low: int, high: int) -> None:
    assert check(kind, low) == low
    assert check(kind, high) == high
    refuse(kind, low - 1, "greater than or equal")
    refuse(kind, high + 1, "less than or equal")
    for value in (str(low), True, float(low)):
        refuse(kind, value, "valid integer")


def test_instance_memory_is_64_mib_to_16_tib_in_whole_mib() -> None:
    assert check(values.InstanceMemory, 64 * MIB) == 64 * MIB
    assert check(values.InstanceMemory, 1 << 44) == 1 << 44
    refuse(values.InstanceMemory, 63 * MIB, "must be at least 64 MiB")
    refuse(values.InstanceMemory, (1 << 44) + MIB, "must be at most")
    refuse(values.InstanceMemory, 100 * MIB + 1, "whole number of MiB")
    refuse(values.InstanceMemory, "268435456", "valid integer")


def test_capacity_is_whole_mib_up_to_a_pib() -> None:
    assert check(values.Capacity, MIB) == MIB
    refuse(values.Capacity, 0, "must be at least 1 MiB")
    refuse(values.Capacity, (1 << 50) + MIB, "must be at most")
    refuse(values.Capacity, MIB + 1, "whole number of MiB")


def test_ratios_are_decimal_strings_from_0_to_16() -> None:
    for value in ("0", "1", "1.5", "16", "2.125"):
        assert check(values.Ratio, value) == value
    refuse(values.Ratio, "17", "out of range")
    refuse(values.Ratio, "1.2345", "more than three decimal places")
    refuse(values.Ratio, "abc", "expected a decimal number")
    refuse(values.Ratio, 1.5, "valid string")


def test_reasons_are_bounded_text() -> None:
    assert check(values.Reason, "x" * 4000)
    refuse(values.Reason, "x" * 4001, "at most 4000")
    refuse(values.Reason, 5, "valid string")
    assert values.clip("x" * 5000) == "x" * 3999 + "…"
    assert values.clip("short") == "short"
    assert values.clip(None) is None


@pytest.mark.parametrize(("kind", "ok", "bad"), [(kind, ok, bad)
                                                  for kind, _, ok, bad in ID_CASES])
def test_id_types_state_their_shape_as_a_schema_pattern(kind: Any, ok: list[str],
                                                        bad: list[str]) -> None:
    """The pattern in the JSON schema (ctrl's OpenAPI document) accepts exactly what the
    check accepts, read as JSON Schema reads it (a search)."""
    pattern = TypeAdapter(kind).json_schema()["pattern"]
    for value in ok:
        assert re.search(pattern, value), (pattern, value)
    for value in bad:
        assert not re.search(pattern, value), (pattern, value)


@pytest.mark.parametrize("text", ["line\nnext", "\x1b[31mred", "a\x00b", "c1\x9b", "s\u2028"])
def test_free_text_refuses_control_characters(text: str) -> None:
    with pytest.raises(ValidationError, match="must not contain control characters"):
        TypeAdapter(values.Reason).validate_python(text)
    with pytest.raises(ValidationError, match="must not contain control characters"):
        TypeAdapter(values.Printable).validate_python(text)
    # A sender writes them as escapes: nothing lost, and the field takes it.
    sent = values.clip(text)
    assert sent is not None
    assert TypeAdapter(values.Reason).validate_python(sent) == sent
    assert "\\x" in sent or "\\u" in sent


def test_clip_escapes_then_cuts() -> None:
    sent = values.clip("\n" * values.MAX_REASON)
    assert sent is not None
    assert len(sent) == values.MAX_REASON
    assert sent.startswith("\\x0a\\x0a")
    assert sent.endswith("…")
    assert values.clip("plain é") == "plain é"
    schema = TypeAdapter(values.Reason).json_schema()
    assert re.search(schema["pattern"], "plain é")
    assert not re.search(schema["pattern"], "a\nb")
