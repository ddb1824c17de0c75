"""click parameter types for numbers, read as `kibotos.core.units` reads them: ASCII digits.

click's own ``INT``, ``IntRange`` and ``FloatRange`` call `int` and `float`, which take
``1_0``, `` 5 ``, ``+5``, ``1e3``, ``nan`` and Unicode digits (``٣``); an option then
means something other than what the operator sees.  These types take only what
`kibotos.core.units.parse_int` and `kibotos.core.units.parse_decimal` take, with click's usage
error (exit code 2) naming the option otherwise.
"""

from __future__ import annotations

from typing import Any

import click

from kibotos.core import units
from kibotos.core.errors import InvalidArgument


class AsciiInt(click.ParamType[int, Any]):
    """An integer in ASCII digits within ``[min, max]`` (either bound may be left out)."""

    name = "integer"

    def __init__(self, min: int | None = None, max: int | None = None) -> None:
        self.min, self.max = min, max

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value  # a default given in the code
        else:
            try:
                number = units.parse_int(str(value), "integer")
            except InvalidArgument as exc:
                self.fail(exc.message, param, ctx)
        if (self.min is not None and number < self.min) or (
                self.max is not None and number > self.max):
            self.fail(f"{number} is not in the range {_range(self.min, self.max)}",
                      param, ctx)
        return number


class AsciiFloat(click.ParamType[float, Any]):
    """A non-negative decimal in ASCII (``2``, ``0.5``), at least `min`."""

    name = "number"

    def __init__(self, min: float = 0.0) -> None:
        self.min = min

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        else:
            try:
                number = float(units.parse_decimal(str(value), "number"))
            except InvalidArgument as exc:
                self.fail(exc.message, param, ctx)
        if number < self.min:
            self.fail(f"{value} is smaller than {self.min}", param, ctx)
        return number


def _range(low: int | None, high: int | None) -> str:
    return f"{'' if low is None else low}..{'' if high is None else high}"
