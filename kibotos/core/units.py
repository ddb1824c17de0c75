"""Parsing of the human units used in configuration, on the command line and in the API.

Numbers are ASCII decimal digits with an optional ASCII decimal fraction, nothing
else: no sign, no exponent, no ``_`` separator, no surrounding or inner space, no
Unicode digit (``٣``, ``３``, ``²``).  Python's own readers (`int`, `float`,
`decimal.Decimal`, ``\\d`` without `re.ASCII`) take all of those, so ``--cpu 1_0``
set a ratio of 10 and ``--cpu ٣`` three cores; a number here means what it shows.
"""

from __future__ import annotations

import re
from decimal import Decimal

from kibotos.core.errors import InvalidArgument

_NUMBER = r"[0-9]+(?:\.[0-9]+)?"
_DECIMAL = re.compile(_NUMBER, re.ASCII)
_INTEGER = re.compile(r"[0-9]+", re.ASCII)
#: A JSON number (RFC 8259), in ASCII: what an HTTP query's number parameter may be,
#: as the API's document types it (JSON Schema) and clients format it (``1e-05``).
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?", re.ASCII)
_SIZE = re.compile(rf"({_NUMBER})([KMGTP]?)(i?B?)?", re.IGNORECASE | re.ASCII)
_SIZE_FACTORS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
_DURATION = re.compile(rf"({_NUMBER})(ms|s|m|h|d)", re.ASCII)
_DURATION_FACTORS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
#: More digits than any quantity of ours has: refused before `int` or `Decimal`
#: spends time on them.
_MAX_DIGITS = 40


def parse_int(value: str, what: str = "number") -> int:
    """A non-negative integer written in ASCII digits only (``"12"``; not ``"1_2"``,
    ``" 12"``, ``"+12"`` or ``"١٢"``)."""
    if len(value) > _MAX_DIGITS or not _INTEGER.fullmatch(value):
        raise InvalidArgument(f"invalid {what} {value[:_MAX_DIGITS]!r}: expected ASCII "
                              "digits 0-9 only")
    return int(value)


def parse_decimal(value: str, what: str = "number") -> Decimal:
    """A non-negative decimal written in ASCII (``"2"``, ``"0.5"``; no exponent, sign,
    ``_``, space or Unicode digit)."""
    if len(value) > _MAX_DIGITS or not _DECIMAL.fullmatch(value):
        raise InvalidArgument(f"invalid {what} {value[:_MAX_DIGITS]!r}: expected a decimal "
                              "number in ASCII digits, e.g. 2 or 0.5")
    return Decimal(value)


def parse_json_number(value: str, what: str = "number") -> float:
    """A number in JSON's syntax (``2``, ``0.5``, ``-1``, ``1e-05``; no ``_``, space,
    ``+``, Unicode digit, ``inf`` or ``nan``), for an HTTP query parameter."""
    if len(value) > _MAX_DIGITS or not _JSON_NUMBER.fullmatch(value):
        raise InvalidArgument(f"invalid {what} {value[:_MAX_DIGITS]!r}: expected a number "
                              "in JSON syntax and ASCII digits, e.g. 2, 0.5 or 1e-3")
    number = float(value)
    if number in (float("inf"), float("-inf")):
        raise InvalidArgument(f"{what} {value[:_MAX_DIGITS]!r} is out of range")
    return number


def parse_size(value: str | int, what: str = "size") -> int:
    """``"8G"``, ``"512MiB"``, ``"100G"`` or a byte count; binary units throughout."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be a size, not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(f"{what} must not be negative: {value}")
        return value
    m = _SIZE.fullmatch(value) if len(value) <= _MAX_DIGITS else None
    if not m:
        raise InvalidArgument(f"invalid {what} {value!r}: expected a number with K, M, G, T or P")
    return int(Decimal(m.group(1)) * _SIZE_FACTORS[m.group(2).upper()])


def parse_duration(value: str | float | int, what: str = "duration") -> float:
    """``"10m"``, ``"1h30m"``, ``"500ms"`` or seconds as a number."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be a duration, not {value!r}")
    if isinstance(value, int | float):
        if not 0 <= value < float("inf"):
            raise InvalidArgument(f"{what} must be a finite number of seconds, not "
                                  f"negative: {value}")
        return float(value)
    text = value
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DURATION_FACTORS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        if len(text) <= _MAX_DIGITS and _DECIMAL.fullmatch(text):
            return float(text)
        raise InvalidArgument(f"invalid {what} {value[:_MAX_DIGITS]!r}: expected e.g. 30s, "
                              "10m, 1h30m")
    return total


def parse_ratio(value: str, what: str = "ratio") -> int:
    """An overcommit ratio: a decimal in [0, 16] with at most three decimal places,
    returned in thousandths so it is stored and compared exactly."""
    if value.startswith("-") and _DECIMAL.fullmatch(value[1:]):
        raise InvalidArgument(f"{what} {value} is out of range: must be between 0 and 16")
    d = parse_decimal(value, what)
    if d > 16:
        raise InvalidArgument(f"{what} {value} is out of range: must be between 0 and 16")
    exponent = d.as_tuple().exponent
    if isinstance(exponent, int) and exponent < -3 and d != d.quantize(Decimal("0.001")):
        raise InvalidArgument(f"{what} {value} has more than three decimal places")
    return int(d * 1000)


def format_ratio(thousandths: int) -> str:
    d = (Decimal(thousandths) / 1000).normalize()
    return f"{d:f}"


def format_bytes(n: int) -> str:
    """The largest binary unit, one decimal place (spec: nodes, list columns)."""
    for unit, factor in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20),
                         ("KiB", 2**10)):
        if abs(n) >= factor:
            return f"{n / factor:.1f}{unit}"
    return f"{n}B"


def format_cores(millis: int) -> str:
    d = (Decimal(millis) / 1000).normalize()
    return f"{d:f}"
