"""Frames to text and back, and what a bad one is reported as.

A frame that is not JSON, not an object, or not valid for its ``type`` is a
`ProtocolError` whose text names every bad field (``invalid hello message: node_id:
invalid node ID 'A': …``); the side that receives it closes the session with it or
logs it, as the session's rules say.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from kibotos.protocol import json_text
from kibotos.protocol.messages import Message

_M = TypeVar("_M", bound=BaseModel)


class ProtocolError(Exception):
    """A frame that is not a valid message."""


def describe(exc: ValidationError) -> str:
    """Every error of `exc` as ``field.path: what is wrong`` (a rule over several
    fields says only what is wrong), joined by ``; ``."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        else:
            msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def decode(text: str | bytes) -> dict[str, Any]:
    """One frame's JSON object; it must have a string ``type``.  The text is read by
    `kibotos.protocol.json_text` (depth limit, no duplicate keys), so a hostile frame
    is a `ProtocolError`, never a `RecursionError` that ends the session uncaught."""
    try:
        data = json_text.loads(text)
    except json_text.JsonTextError as exc:
        raise ProtocolError(f"frame is not JSON this protocol accepts: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ProtocolError("frame is not a JSON object with a string 'type'")
    return data


def parse(model: type[_M], data: dict[str, Any]) -> _M:
    """`data` as a `model`, or `ProtocolError` naming the bad fields."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ProtocolError(f"invalid {data.get('type')} message: {describe(exc)}") from None


def encode(message: Message | dict[str, Any]) -> str:
    """The frame's text: a `Message`, or an already built JSON object."""
    body = message.to_wire() if isinstance(message, Message) else message
    return json.dumps(body, separators=(",", ":"))
