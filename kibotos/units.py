"""Parsing of the human units used in configuration and on the command line."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from kibotos.errors import InvalidArgument

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?B?)?\s*", re.IGNORECASE)
_SIZE_FACTORS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_FACTORS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(value: str | int, what: str = "size") -> int:
    """``"8G"``, ``"512MiB"``, ``"100G"`` or a byte count; binary units throughout."""
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(f"{what} must not be negative: {value}")
        return value
    m = _SIZE.fullmatch(value)
    if not m:
        raise InvalidArgument(f"invalid {what} {value!r}: expected a number with K, M, G, T or P")
    return int(Decimal(m.group(1)) * _SIZE_FACTORS[m.group(2).upper()])


def parse_duration(value: str | float | int, what: str = "duration") -> float:
    """``"10m"``, ``"1h30m"``, ``"500ms"`` or seconds as a number."""
    if isinstance(value, int | float):
        if value < 0:
            raise InvalidArgument(f"{what} must not be negative: {value}")
        return float(value)
    text = value.strip()
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DURATION_FACTORS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        try:
            return float(text)
        except ValueError:
            raise InvalidArgument(
                f"invalid {what} {value!r}: expected e.g. 30s, 10m, 1h30m"
            ) from None
    return total


def parse_ratio(value: str, what: str = "ratio") -> int:
    """An overcommit ratio: a decimal in [0, 16] with at most three decimal places,
    returned in thousandths so it is stored and compared exactly."""
    try:
        d = Decimal(value.strip())
    except InvalidOperation:
        raise InvalidArgument(f"invalid {what} {value!r}: expected a decimal number") from None
    if not d.is_finite():
        raise InvalidArgument(f"invalid {what} {value!r}: expected a decimal number")
    if d < 0 or d > 16:
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
