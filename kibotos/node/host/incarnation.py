"""The node's incarnation: a number that grows by one on every start of the node process.

ctrl tells processes of one node apart by it: an isolate declaration invalidates the
incarnation that was current, so a node that comes back with the same number must be
told to destroy its Instances, while a restarted one (a higher number) clears the
isolate.  That only works if the number never goes backwards, hence: persisted with an
atomic write *before* the session starts, and a corrupt file stops the start instead of
silently starting over at 1 (which ctrl would refuse as stale anyway).
"""

from __future__ import annotations

from pathlib import Path

from kibotos.core import atomicfile, failpoints
from kibotos.core.errors import FailedPrecondition


def read_incarnation(path: Path) -> int | None:
    """The last persisted incarnation, or None on a node that never started."""
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise FailedPrecondition(f"cannot read incarnation file {path}: {exc}") from None
    value = text.strip()
    if not value.isdigit() or int(value) < 1 or text != f"{value}\n":
        raise FailedPrecondition(
            f"incarnation file {path} is corrupt (content {text[:40]!r}, expected a positive "
            "decimal number and a newline); the node will not reset it, because a lower "
            "incarnation would be refused by ctrl: restore it, or write a number higher than "
            "the node's latest incarnation shown by `kibo node get --wide`"
        )
    return int(value)


def next_incarnation(path: Path) -> int:
    """Persist and return the incarnation of this start: the previous one plus one."""
    previous = read_incarnation(path)
    incarnation = 1 if previous is None else previous + 1
    atomicfile.write_bytes(path, f"{incarnation}\n".encode(), mode=0o600)
    failpoints.hit("node.incarnation.after-write")
    return incarnation
