"""The characters a terminal acts on instead of showing, in a module of its own so that
`kibo`'s output (which must not import pydantic, for its start-up time) and the strict
input types of `kibotos.protocol.values` share one definition."""

from __future__ import annotations

import re

#: C0 controls, DEL, C1 controls and the Unicode line and paragraph separators: what a
#: terminal acts on instead of showing.  `Printable` refuses them at input; the CLI
#: escapes them at output (`kibotos.cli.output.printable`), for records older than that.
CONTROL_CHARACTERS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
