"""`kibotos.core.units` reads numbers in ASCII digits only (issue 16): ``int``, ``float`` and
``Decimal`` take ``1_0``, spaces, signs, exponents and Unicode digits, so an input
meant something other than what it showed."""

from __future__ import annotations

from decimal import Decimal

import pytest

from kibotos.config import ResourcesSection
from kibotos.core import units
from kibotos.core.errors import InvalidArgument

NOT_NUMBERS = ["1_0", " 1", "1 ", "+1", "-1", "1e3", "nan", "inf", "\u0663", "\uff11",
               "\u00b2", "1.", ".5", "", "0x10", "1" * 41]


@pytest.mark.parametrize("text", NOT_NUMBERS)
def test_parse_int_and_decimal_refuse(text: str) -> None:
    with pytest.raises(InvalidArgument, match="ASCII"):
        units.parse_int(text)
    with pytest.raises(InvalidArgument, match="ASCII"):
        units.parse_decimal(text)


@pytest.mark.parametrize("text", [*NOT_NUMBERS, "1_0G", "\u0663G", " 8G", "8G ", "8 G"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(InvalidArgument):
        units.parse_size(text)


@pytest.mark.parametrize("text", [*NOT_NUMBERS, "1_0s", "\u0663s", " 5s", "1h 30m"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(InvalidArgument):
        units.parse_duration(text)


@pytest.mark.parametrize("value", [True, float("nan"), float("inf"), -1])
def test_parse_duration_refuses_odd_numbers(value: float) -> None:
    with pytest.raises(InvalidArgument):
        units.parse_duration(value)


@pytest.mark.parametrize("text", ["1_0", "\u0663", " 2", "2 ", "1e1", "NaN", "Infinity"])
def test_parse_ratio_refuses(text: str) -> None:
    with pytest.raises(InvalidArgument):
        units.parse_ratio(text)


def test_what_is_real_still_parses() -> None:
    assert units.parse_int("0012") == 12
    assert units.parse_decimal("0.5") == Decimal("0.5")
    assert units.parse_size("8G") == 8 << 30
    assert units.parse_size("512MiB") == 512 << 20
    assert units.parse_size("1.5K") == 1536
    assert units.parse_duration("1h30m") == 5400
    assert units.parse_duration("2.5") == 2.5
    assert units.parse_ratio("2.5") == 2500
    assert units.parse_size(7) == 7
    with pytest.raises(InvalidArgument):
        units.parse_size(True)


@pytest.mark.parametrize("cpu", ["1_0", "\u0663", " 4", "nan", True, float("inf")])
def test_node_toml_cpu_is_ascii(cpu: object) -> None:
    with pytest.raises(ValueError, match="cpu"):
        ResourcesSection.model_validate({"cpu": cpu, "memory": "1G"})
    assert ResourcesSection.model_validate({"cpu": "2.5", "memory": "1G"}).cpu_millis == 2500


def test_a_query_number_is_read_in_json_syntax() -> None:
    """What the OpenAPI document's ``number`` query parameters are: JSON numbers, as
    clients format them (``1e-05``), in ASCII only."""
    assert units.parse_json_number("2") == 2.0
    assert units.parse_json_number("0.5") == 0.5
    assert units.parse_json_number("2.225073858507203e-309") > 0
    assert units.parse_json_number("-1") == -1.0
    for bad in ("1_0", " 5", "+5", "٣", "inf", "nan", "1e999", "0x10", ".5", "05", ""):
        with pytest.raises(InvalidArgument):
            units.parse_json_number(bad)
