"""The characters a terminal acts on instead of showing, in a module of its own so that
`kibo`'s output (which must not import pydantic, for its start-up time) and the strict
input types of `kibotos.protocol.values` share one definition."""

from __future__ import annotations

import re

#: C0 controls, DEL, C1 controls and the Unicode line and paragraph separators: what a
#: terminal acts on instead of showing.  `Printable` refuses them at input; the CLI
#: escapes them at output (`kibotos.cli.core.output.printable`), for records older than that.
_CONTROLS = r"\x00-\x1f\x7f-\x9f\u2028\u2029"
CONTROL_CHARACTERS = re.compile(f"[{_CONTROLS}]")
#: Text with none of them, written in escapes that Python and ECMA-262 read alike: the
#: JSON Schema ``pattern`` of `Printable` in ctrl's OpenAPI document.
PRINTABLE_TEXT = re.compile(f"[^{_CONTROLS}]*")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    """`text` with every control character written as its escape (ESC is ``\\x1b``, a
    newline ``\\x0a``): one line, printable, with nothing of the original lost.  The CLI
    shows server text through it; a node sends its error texts (reasons) through it, as
    the session's free-text fields refuse control characters."""
    return CONTROL_CHARACTERS.sub(_escape, text)
