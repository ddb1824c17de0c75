"""The one renderer of the operator CLI: tables and sections for people, JSON for scripts.

Rules every command follows through this module, so they hold everywhere at once:

* data goes to stdout, messages and errors to stderr;
* ``--json`` prints ``{"result": …}`` with the API result as is; an error prints
  ``{"error": {"code", "message"}}`` on stdout as well, so a script piping into ``jq``
  sees a structured answer, while the human line ``error: <code>: <message>`` always
  goes to stderr;
* every text that reaches a person goes through `printable` first: table cells and
  titles, section labels and values, lines, messages, warnings and errors.  Strings
  come from the server, and through it from nodes and other operators (a node's
  ``release_version``, a grant's ``name``, an Instance's ``reason``, records written
  before ctrl refused such input); a control character in one would move the cursor,
  recolour or clear the operator's terminal, or start a fake table row.  ``--json``
  keeps the exact strings: JSON escapes them itself;
* when stdout is not a terminal, or ``KIBO_ASCII=1``, tables use an ASCII box and no
  colour, so snapshots and ``awk`` see stable text; ``COLUMNS`` sets the width, and a
  pipe without ``COLUMNS`` gets a width wide enough never to wrap a row.

That plain text is written by `kibotos.cli.core.plain_text` exactly as rich would print it;
rich itself is imported only to draw for a terminal (or the rare text the plain writer
leaves to it), so a ``kibo`` in a pipe or a script does not pay for its import.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

import click

from kibotos.cli.core import plain_text
from kibotos.core.control_chars import escape_controls
from kibotos.core.errors import KibotosError

if TYPE_CHECKING:
    from rich.console import Console

#: A table row or a section line; every cell is already a display string.
Row = Sequence[str]

# Without a terminal and without COLUMNS nothing reads the width: do not wrap rows.
_PIPE_WIDTH = 1000


def printable(text: str) -> str:
    """`text` with every control character written as its escape (ESC is ``\\x1b``, a
    newline ``\\x0a``): one line, shown as it is, acted on by no terminal."""
    return escape_controls(text)


def yes_no(value: object) -> str:
    """Booleans as people read them; a missing value is ``-``, never ``no``."""
    if value is None:
        return "-"
    return "yes" if value else "no"


def dash(value: object) -> str:
    """Any scalar for display; ``None`` (not readable, not reported) is ``-``."""
    return "-" if value is None or value == "" else str(value)


@dataclass
class Section:
    """A titled block of ``label: value`` lines, as `kibo node get` prints them."""

    title: str
    lines: list[tuple[str, str]] = field(default_factory=list)

    def add(self, label: str, value: str) -> None:
        self.lines.append((label, value))

    def add_fields(self, record: Mapping[str, Any], fields: Mapping[str, str],
                   show: Callable[[object], str] = dash) -> None:
        """A line per ``label: key`` of `fields`, in their order: the record's value
        under the key, as `show` renders it.  Most lines of a section are a field of
        the API result shown as is; a table of labels and keys says which at a glance."""
        for label, key in fields.items():
            self.add(label, show(record.get(key)))


def _ascii_mode(stream: IO[str]) -> bool:
    if os.environ.get("KIBO_ASCII") == "1":
        return True
    isatty = getattr(stream, "isatty", None)
    return not (callable(isatty) and isatty())


def _columns() -> int | None:
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else None


def _write(stream: IO[str], text: str) -> None:
    stream.write(text)
    stream.flush()


def _console(stream: IO[str], width: int | None = None) -> Console:
    from rich.console import Console

    ascii_mode = _ascii_mode(stream)
    if width is None:
        width = _columns()
    if width is None and ascii_mode:
        width = _PIPE_WIDTH
    return Console(
        file=stream,
        width=width,
        no_color=ascii_mode,
        color_system=None if ascii_mode else "auto",
        force_terminal=False if ascii_mode else None,
        highlight=False,
        markup=False,
        emoji=False,
    )


def rich_table(stream: IO[str], columns: Sequence[str], rows: Sequence[Row],
               title: str | None) -> None:
    """A table drawn by rich: rounded and bold on a terminal, ASCII2 otherwise."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    ascii_mode = _ascii_mode(stream)
    table = Table(
        box=box.ASCII2 if ascii_mode else box.ROUNDED,
        title=Text(title) if title else None,
        title_justify="left",
        header_style="" if ascii_mode else "bold",
        show_edge=True,
        pad_edge=True,
    )
    # Cells never wrap and are never cut: a table wider than COLUMNS is printed whole
    # and the terminal wraps its lines (as kubectl does), so no value is lost.
    widths = [max([len(name)] + [len(row[i]) for row in rows])
              for i, name in enumerate(columns)]
    for name in columns:
        table.add_column(Text(name), no_wrap=True)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    console = _console(stream)
    needed = sum(widths) + 3 * len(columns) + 1
    if needed > console.width:
        console = _console(stream, width=needed)
    console.print(table)


def rich_sections(stream: IO[str], sections: Sequence[Section]) -> None:
    from rich.text import Text

    console = _console(stream)
    for i, section in enumerate(sections):
        if i:
            console.print()
        console.print(Text(section.title, style="" if _ascii_mode(stream) else "bold"))
        width = max((len(label) for label, _ in section.lines), default=0)
        for label, value in section.lines:
            console.print(Text(f"  {label + ':':<{width + 1}} {value}"), soft_wrap=True)


class Output:
    """Where one invocation writes; built once per command by the shared options."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    # ------------------------------------------------------------------ data (stdout)

    def json_result(self, value: Any) -> None:
        click.echo(json.dumps({"result": value}, indent=2, ensure_ascii=False))

    def result(self, value: Any, for_people: Callable[[], object]) -> None:
        """A command's result: with ``--json`` the API result as is, else what
        `for_people` prints.  The one switch between scripts and people, so no command
        can print both; `for_people` runs only for people, so a script never depends on
        how a result renders."""
        if self.as_json:
            self.json_result(value)
        else:
            for_people()

    def line(self, text: str) -> None:
        """One line of data on stdout (a token, an ID, a summary of a write)."""
        click.echo(printable(text))

    def table(self, columns: Sequence[str], rows: Sequence[Row], *,
              title: str | None = None) -> None:
        stream = sys.stdout
        # Every cell and the title escaped (records may hold what a peer sent).
        title = printable(title) if title else title
        rows = [[printable(cell) for cell in row] for row in rows]
        plain = plain_text.table(columns, rows, title) if _ascii_mode(stream) else None
        if plain is None:
            rich_table(stream, columns, rows, title)
        else:
            _write(stream, plain)

    def sections(self, sections: Sequence[Section]) -> None:
        """Sections separated by a blank line; labels aligned within each section."""
        stream = sys.stdout
        sections = [Section(printable(s.title), [(printable(label), printable(value))
                                                 for label, value in s.lines])
                    for s in sections]
        plain = None
        if _ascii_mode(stream):
            plain = plain_text.sections([(s.title, s.lines) for s in sections],
                                        _columns() or _PIPE_WIDTH)
        if plain is None:
            rich_sections(stream, sections)
        else:
            _write(stream, plain)

    # ------------------------------------------------------------- messages (stderr)

    def message(self, text: str) -> None:
        """Progress and notes for the person at the terminal; never data."""
        click.echo(printable(text), err=True)

    def warning(self, text: str) -> None:
        click.echo(f"warning: {printable(text)}", err=True)

    def error(self, exc: KibotosError) -> None:
        if self.as_json:
            click.echo(json.dumps(exc.to_wire(), indent=2, ensure_ascii=False))
        click.echo(f"error: {printable(exc.code)}: {printable(exc.message)}", err=True)


def stdin_is_terminal() -> bool:
    """Whether a person can answer a confirmation prompt."""
    return sys.stdin is not None and sys.stdin.isatty()


def confirm_or_abort(yes: bool, command: str, question: str) -> None:
    """Before a write that cannot be undone: unless ``--yes``, ask `question` and abort
    on anything but yes.  Without a terminal nobody can answer, so the command is
    refused (a usage error) rather than run or silently skipped: a script says --yes."""
    if yes:
        return
    if not stdin_is_terminal():
        raise click.UsageError(f"{command} asks for confirmation; without a terminal, "
                               "add --yes")
    if not click.confirm(question, default=False, err=True):
        raise click.Abort()
