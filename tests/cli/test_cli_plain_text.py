"""The plain writer (`kibotos.cli.core.plain_text`) prints what rich prints, byte for byte.

``kibo`` in a pipe writes its ASCII tables and sections itself so as not to import rich;
these tests draw the same generated tables and sections both ways (rich through
`kibotos.cli.core.output.rich_table` / `rich_sections`, the code a terminal still uses) and
compare, and check that the plain writer hands back (None) what it does not lay out.
"""

from __future__ import annotations

import io
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kibotos.cli.core import plain_text
from kibotos.cli.core.output import Section, rich_sections, rich_table

# Printable ASCII with spaces (rich keeps them inside cells) and the characters the
# renderers care about: the box's own ``|+-`` and the label's ``:``.
# Beyond ASCII: the one-cell characters the plain writer claims (kibo prints ``±`` and
# ``×``), checked against rich's own widths below.
NARROW = "±×éß·…–→ŝ"
CELL = st.text(alphabet=string.ascii_letters + string.digits + " -_|+:./=" + NARROW,
               max_size=12)
TITLE = st.text(alphabet=string.ascii_letters + " -" + NARROW, min_size=1, max_size=40)


@pytest.fixture(autouse=True)
def _ascii(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KIBO_ASCII", "1")
    monkeypatch.delenv("COLUMNS", raising=False)


@st.composite
def tables(draw: st.DrawFn) -> tuple[list[str], list[list[str]], str | None]:
    columns = draw(st.lists(CELL, min_size=1, max_size=5))
    rows = draw(st.lists(st.lists(CELL, min_size=len(columns), max_size=len(columns)),
                         max_size=4))
    title = draw(st.none() | TITLE)
    return columns, rows, title


def by_rich(columns: list[str], rows: list[list[str]], title: str | None) -> str:
    out = io.StringIO()
    rich_table(out, columns, rows, title)
    return out.getvalue()


@settings(max_examples=300, deadline=None)
@given(tables())
def test_tables_match_rich(table: tuple[list[str], list[list[str]], str | None]) -> None:
    columns, rows, title = table
    plain = plain_text.table(columns, rows, title)
    if plain is None:  # only a title longer than the table is left to rich here
        assert title is not None
        width = sum(max([len(c)] + [len(r[i]) for r in rows])
                    for i, c in enumerate(columns)) + 3 * len(columns) + 1
        assert len(title) > width
        return
    assert plain == by_rich(columns, rows, title)


def test_a_snapshot_table_and_an_empty_one() -> None:
    rows = [["node-a", "READY"], ["node-bb", "-"]]
    assert plain_text.table(["NODE", "STATUS"], rows, "Nodes") == (
        "Nodes               \n"
        "+---------+--------+\n"
        "| NODE    | STATUS |\n"
        "+---------+--------+\n"
        "| node-a  | READY  |\n"
        "| node-bb | -      |\n"
        "+---------+--------+\n") == by_rich(["NODE", "STATUS"], rows, "Nodes")
    assert plain_text.table(["A"], [], None) == "+---+\n| A |\n+---+\n+---+\n" == by_rich(
        ["A"], [], None)


def test_every_character_claimed_is_one_cell_for_rich() -> None:
    from rich.cells import cell_len

    claimed = [chr(c) for c in range(0x20, 0x2200) if plain_text.table([chr(c)], [], None)]
    assert len(claimed) > 600
    assert [c for c in claimed if cell_len(c) != 1] == []
    assert not {"\xad", "\u0301", "\u200b"} & set(claimed)


@pytest.mark.parametrize("cell", ["wide 表", "e\u0301", "zero\u200bwidth", "tab\there",
                                  "new\nline", "\x1b[31m", "\xa0nbsp", "soft\xadhyphen"])
def test_text_beyond_printable_ascii_is_left_to_rich(cell: str) -> None:
    assert plain_text.table(["A"], [[cell]], None) is None
    assert plain_text.table([cell], [], None) is None
    assert plain_text.sections([("Title", [("label", cell)])], 1000) is None
    assert plain_text.sections([(cell, [])], 1000) is None


@st.composite
def section_lists(draw: st.DrawFn) -> list[Section]:
    blocks = draw(st.lists(st.tuples(TITLE, st.lists(st.tuples(CELL, CELL), max_size=4)),
                           max_size=3))
    return [Section(title, list(lines)) for title, lines in blocks]


@settings(max_examples=200, deadline=None)
@given(section_lists(), st.sampled_from([None, 20, 80, 200]))
def test_sections_match_rich(sections: list[Section], columns: int | None) -> None:
    with pytest.MonkeyPatch.context() as mp:
        if columns is not None:
            mp.setenv("COLUMNS", str(columns))
        out = io.StringIO()
        rich_sections(out, sections)
    width = columns or 1000
    plain = plain_text.sections([(s.title, s.lines) for s in sections], width)
    if plain is None:  # a title wider than the width: rich wraps it
        assert any(len(s.title) > width for s in sections)
        return
    assert plain == out.getvalue()
