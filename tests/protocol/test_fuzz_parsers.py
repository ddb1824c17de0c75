"""Hypothesis fuzzing of what reads a peer's bytes (issue 16): the node session's frame
parser (`kibotos.protocol.codec`, as ctrl reads a node's frames and the node ctrl's) and
the guest protocol's `FrameDecoder` (both ends of the vsock channel).  Whatever they
are fed, they answer in their own terms (a message or `ProtocolError`; frames or
`FrameError`), never another exception, and the decoder's buffer stays bounded.

Example counts are bounded (``max_examples``) so the whole module takes seconds."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kibotos.guest.kibotos_guest.runtime.framing import (
    HEADER_SIZE,
    KIND_CONTROL,
    KIND_DATA,
    MAX_PAYLOAD,
    RESYNC_PREAMBLE_SIZE,
    Frame,
    FrameDecoder,
    FrameError,
    encode_frame,
)
from kibotos.protocol import CTRL_MESSAGES, NODE_MESSAGES, ProtocolError, decode, parse
from kibotos.testing.fake_node import hello_message

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=10), inner, max_size=4),
    max_leaves=20)
message_types = st.sampled_from(sorted({*NODE_MESSAGES, *CTRL_MESSAGES, "bogus"}))


def _read(text: str | bytes) -> None:
    """A frame as either side reads it: decode, then parse by its ``type``."""
    try:
        data = decode(text)
        model = {**NODE_MESSAGES, **CTRL_MESSAGES}.get(data["type"])
        if model is not None:
            parse(model, data)
    except ProtocolError:
        pass


@FUZZ
@given(st.text(max_size=200) | st.binary(max_size=200))
def test_any_text_is_a_message_or_a_protocol_error(text: str | bytes) -> None:
    _read(text)


@FUZZ
@given(message_types, st.dictionaries(st.text(max_size=20), json_values, max_size=6))
def test_any_object_of_any_type_is_a_message_or_a_protocol_error(
        kind: str, fields: dict[str, Any]) -> None:
    _read(json.dumps({**fields, "type": kind}))


hello_fields = st.sampled_from(sorted(hello_message("node-a", 1)))


@FUZZ
@given(st.dictionaries(hello_fields, json_values, min_size=1, max_size=4),
       st.integers(min_value=0, max_value=40))
def test_a_mutated_hello_is_a_hello_or_a_protocol_error(changes: dict[str, Any],
                                                        depth: int) -> None:
    hello = {**hello_message("node-a", 1), **changes, "type": "hello"}
    _read(json.dumps(hello))
    # and nested deep, as a hostile node sends it
    _read(json.dumps(hello)[:-1] + ', "facts": ' + "[" * (depth * 40) + "]" * (depth * 40)
          + "}")


frames = st.lists(st.tuples(st.sampled_from([KIND_CONTROL, KIND_DATA]),
                            st.integers(min_value=0, max_value=2**32 - 1),
                            st.binary(max_size=300), st.sampled_from([0, 1])),
                  max_size=5)


def _feed(decoder: FrameDecoder, data: bytes, cuts: list[int]) -> list[Frame | FrameError]:
    out: list[Frame | FrameError] = []
    start = 0
    for cut in sorted({c % (len(data) + 1) for c in cuts} | {len(data)}):
        out.extend(decoder.feed(data[start:cut]))
        start = cut
        assert decoder.buffered() <= HEADER_SIZE + MAX_PAYLOAD
    return out


@FUZZ
@given(frames, st.lists(st.integers(min_value=0), max_size=8))
def test_frames_come_out_whole_however_the_bytes_are_cut(
        specs: list[tuple[int, int, bytes, int]], cuts: list[int]) -> None:
    data = b"".join(encode_frame(kind, stream, payload, flags)
                    for kind, stream, payload, flags in specs)
    got = _feed(FrameDecoder(), data, cuts)
    assert got == [Frame(kind, flags, stream, payload)
                   for kind, stream, payload, flags in specs]


@FUZZ
@given(st.binary(max_size=600), frames, st.lists(st.integers(min_value=0), max_size=6))
def test_garbage_then_the_preamble_resynchronises(
        garbage: bytes, specs: list[tuple[int, int, bytes, int]], cuts: list[int]) -> None:
    """Any bytes (a dead peer's half frame, noise), then the zero preamble a host sends
    on connect, then frames: the decoder never raises, and the frames come out."""
    good = [Frame(kind, flags, stream, payload) for kind, stream, payload, flags in specs]
    data = garbage + bytes(RESYNC_PREAMBLE_SIZE) + b"".join(
        encode_frame(kind, stream, payload, flags) for kind, stream, payload, flags in specs)
    got = _feed(FrameDecoder(), data, cuts)
    assert all(isinstance(item, Frame | FrameError) for item in got)
    assert got[len(got) - len(good):] == good
