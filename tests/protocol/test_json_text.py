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
])
def test_refused(text: str | bytes, words: str) -> None:
    with pytest.raises(json_text.JsonTextError, match=words):
        json_text.loads(text)


def test_the_depth_limit_is_exact() -> None:
    assert json_text.loads("[" * 32 + "]" * 32) is not None
    with pytest.raises(json_text.JsonTextError):
        json_text.loads("[" * 33 + "]" * 33)


def test_a_real_hello_passes_and_a_hostile_one_is_a_protocol_error() -> None:
    hello = hello_message("node-a", 1)
    assert codec.decode(json.dumps(hello)) == hello
    with pytest.raises(codec.ProtocolError, match="nested deeper"):
        codec.decode(json.dumps(hello)[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}")
