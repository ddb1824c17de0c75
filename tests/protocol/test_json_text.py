"""`kibotos.protocol.json_text`: what ctrl's request bodies and the session's frames
refuse (issue 16), and that real messages pass."""

from __future__ import annotations

import json

import pytest

from kibotos.protocol import codec, json_text
from kibotos.testing.fake_node import hello_message


@pytest.mark.parametrize(("text", "words"), [
    ("[" * 1000 + "]" * 1000, "nested deeper"),
    ("[" * 200_000 + "]" * 200_000, "nested deeper"),
    ('{"a":' * 33 + "1" + "}" * 33, "nested deeper"),
    ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ('{"b": {"a": 1, "a": 1}}', "duplicate key 'a'"),
    ("NaN", "not a JSON number"),
    ('[1, -Infinity]', "not a JSON number"),
    (b"\xff", "not UTF-8"),
    ("{", "not valid JSON"),
    ("1e400", "out of range"),
    ('{"a": [-1.5e999]}', "out of range"),
])
def test_refused(text: str | bytes, words: str) -> None:
    with pytest.raises(json_text.JsonTextError, match=words):
        json_text.loads(text)


def test_a_whole_number_is_an_integer_however_it_is_spelt() -> None:
    """JSON Schema's reading (schemathesis sends ``4224.0`` for an integer field): a
    whole number is an `int`, read exactly; other numbers stay floats."""
    values = json_text.loads("[4224.0, 4.224e3, 9007199254740993.0, 1e20, 1.5, 2.5e-3, 7]")
    assert values == [4224, 4224, 9007199254740993, 10**20, 1.5, 0.0025, 7]
    assert [type(v) for v in values] == [int, int, int, int, float, float, int]
    assert json_text.loads("[true, \"1\"]") == [True, "1"]  # no other kind becomes a number


def test_the_depth_limit_is_exact() -> None:
    assert json_text.loads("[" * 32 + "]" * 32) is not None
    with pytest.raises(json_text.JsonTextError):
        json_text.loads("[" * 33 + "]" * 33)


def test_a_real_hello_passes_and_a_hostile_one_is_a_protocol_error() -> None:
    hello = hello_message("node-a", 1)
    assert codec.decode(json.dumps(hello)) == hello
    with pytest.raises(codec.ProtocolError, match="nested deeper"):
        codec.decode(json.dumps(hello)[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}")
