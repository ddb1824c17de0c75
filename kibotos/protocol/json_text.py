"""JSON text from a peer that may be hostile, read into Python values or refused.

Both ctrl's HTTP request bodies and the node control session's frames come through
`loads`, so the two refuse the same things with the same words:

* nesting deeper than `MAX_DEPTH` (no request or frame of ours goes past a handful of
  levels; Python's own parser would instead raise `RecursionError` around a thousand,
  which is no `ValueError` and escaped as a 500 or a closed session with a traceback);
* a key given twice in one object (the standard library keeps the last one silently,
  so two readers of the same text could disagree on what was asked);
* ``NaN``, ``Infinity`` and ``-Infinity``, which are not JSON (RFC 8259) and no field of
  ours accepts, and a number too large for a double (``1e400``, which Python would read
  as infinity);
* text that is not UTF-8 or not JSON at all.

JSON has one number type: a number with no fractional part is an integer however it is
spelt (``4224``, ``4224.0``, ``4.224e3``), as JSON Schema reads it, so the strict
models' integer fields take it; any other number is a float.  (``true`` and ``"1"``
stay what they are: a boolean and a string.)

Every refusal is a `JsonTextError` (a `ValueError`) whose message says what was wrong;
the callers turn it into their own error (``invalid_argument``, `ProtocolError`).
"""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any

#: The deepest nesting of arrays and objects accepted; far below Python's recursion
#: limit, far above any message of ours.
MAX_DEPTH = 32


class JsonTextError(ValueError):
    """The text is not JSON this system accepts; the message says why."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # built in C; a shorter dict means a key came twice
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JsonTextError(f"duplicate key {key!r} in a JSON object")
            seen.add(key)
    return out


def _constant(name: str) -> Any:
    raise JsonTextError(f"{name} is not a JSON number")


def _number(text: str) -> int | float:
    """A JSON number with a fraction or an exponent: an `int` when its value is whole
    (read exactly, through `Decimal`), else a `float`; refused past a double's range."""
    approximate = float(text)
    if not math.isfinite(approximate):
        raise JsonTextError(f"the number {text[:40]} is out of range")
    exact = Decimal(text)
    if exact == exact.to_integral_value():
        return int(exact)
    return approximate


def _too_deep(value: Any, limit: int) -> bool:
    """Whether `value` nests arrays and objects deeper than `limit` (walked without
    recursion, so a deep value cannot exhaust the stack here either)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, dict | list))
    return False


def loads(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """The value of `text`, or `JsonTextError` saying what makes it unacceptable."""
    try:
        value = json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant,
                           parse_float=_number)
    except JsonTextError:
        raise
    except RecursionError:
        raise JsonTextError(f"JSON nested deeper than {max_depth} levels") from None
    except UnicodeDecodeError:
        raise JsonTextError("JSON text is not UTF-8") from None
    except ValueError as exc:
        raise JsonTextError(f"not valid JSON: {exc}") from None
    # Nesting cannot go deeper than the brackets the text opens: counted in C, this
    # spares the walk for every frame of ordinary size.
    opened = (text.count("{") + text.count("[") if isinstance(text, str)
              else text.count(b"{") + text.count(b"["))
    if opened > max_depth and _too_deep(value, max_depth):
        raise JsonTextError(f"JSON nested deeper than {max_depth} levels")
    return value
