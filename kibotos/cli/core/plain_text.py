"""The ASCII tables and sections of `kibotos.cli.core.output`, without rich.

When stdout is not a terminal (a pipe, a script, a test) or ``KIBO_ASCII=1``, the
renderer prints rich's ``ASCII2`` box with no colour and no wrapping.  That text is
simple enough to write directly, and rich's import (about 0.05 s) was a fifth of a
``kibo node list``.  So the plain path writes it here, byte for byte what rich prints,
and rich is imported only for a terminal, or for text this module does not claim to
lay out as rich would: characters outside a few ranges known to be one cell wide
(wide characters, combining marks, control characters), or a title longer than its
table (rich wraps it).  Then it returns None
and the caller asks rich.  tests/cli/test_cli_plain_text.py compares the two on
generated tables.
"""

from __future__ import annotations

from collections.abc import Sequence


def _narrow(char: str) -> bool:
    code = ord(char)
    return ((code < 0x300 and code != 0xAD)  # Latin, IPA; no soft hyphen, no combining
            or 0x2010 <= code <= 0x2027      # dashes, quotes, bullets, the ellipsis
            or 0x2190 <= code <= 0x21FF)     # arrows


def _plain(text: str) -> bool:
    """Printable text whose every character takes one cell in rich as in a terminal
    (printable ASCII, and the few other ranges kibo prints, such as ``±`` and ``×``);
    anything else is rich's to measure."""
    if text.isascii():
        return text.isprintable()
    return text.isprintable() and all(_narrow(c) for c in text)


def table(columns: Sequence[str], rows: Sequence[Sequence[str]],
          title: str | None) -> str | None:
    """The table as rich's ASCII2 box draws it at its natural width (cells one space
    from each border, never wrapped), or None when rich must draw it."""
    if not all(_plain(cell) for cell in columns) or \
            not all(_plain(cell) for row in rows for cell in row):
        return None
    widths = [max([len(name)] + [len(row[i]) for row in rows])
              for i, name in enumerate(columns)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    lines = []
    if title:
        if not _plain(title) or len(title) > len(rule):
            return None
        lines.append(title.ljust(len(rule)))
    lines += [rule, _row(columns, widths), rule]
    lines += [_row(row, widths) for row in rows]
    lines.append(rule)
    return "\n".join(lines) + "\n"


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "|" + "|".join(f" {cell:<{w}} " for cell, w in zip(cells, widths, strict=True)) + "|"


def sections(blocks: Sequence[tuple[str, Sequence[tuple[str, str]]]],
             width: int) -> str | None:
    """Titled blocks of aligned ``label: value`` lines, a blank line between blocks, as
    rich prints them at `width` (a title is wrapped there, the lines never), or None
    when rich must print them."""
    out = []
    for i, (title, lines) in enumerate(blocks):
        if not _plain(title) or len(title) > width:
            return None
        if i:
            out.append("")
        out.append(title)
        label_width = max((len(label) for label, _ in lines), default=0)
        for label, value in lines:
            line = f"  {label + ':':<{label_width + 1}} {value}"
            if not _plain(line):
                return None
            out.append(line)
    return "".join(line + "\n" for line in out)
