"""The node's log: one line per event, ``message key=value …``.

Operators grep these lines and tests read them from stderr, so the shape is fixed: the
event message first, then the fields in the order given, values quoted only when they
hold spaces, quotes or ``=``.  Under systemd (``JOURNAL_STREAM`` names our stderr) the
lines go to journald through cysystemd, so the priority survives; elsewhere to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

LOGGER_NAME = "kibotos.node"
JOURNAL_SOCKET = "/run/systemd/journal/socket"
_NEEDS_QUOTES = frozenset(' "=\t\n')


def _value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if not text or any(c in _NEEDS_QUOTES for c in text):
        return json.dumps(text)
    return text


def format_event(message: str, fields: dict[str, Any]) -> str:
    """``format_event("session up", {"session_id": "ses-1"})`` → ``session up session_id=ses-1``."""
    parts = [message]
    parts.extend(f"{key}={_value(value)}" for key, value in fields.items())
    return " ".join(parts)


class EventLogger:
    """A thin wrapper over `logging` that takes the fields as keywords."""

    def __init__(self, name: str = LOGGER_NAME) -> None:
        self._log = logging.getLogger(name)

    def info(self, message: str, /, **fields: Any) -> None:
        self._log.info("%s", format_event(message, fields))

    def warning(self, message: str, /, **fields: Any) -> None:
        self._log.warning("%s", format_event(message, fields))

    def error(self, message: str, /, **fields: Any) -> None:
        self._log.error("%s", format_event(message, fields))

    def debug(self, message: str, /, **fields: Any) -> None:
        self._log.debug("%s", format_event(message, fields))


def _stderr_is_journal() -> bool:
    """systemd sets ``JOURNAL_STREAM=<dev>:<ino>`` of the stream it connected to stderr;
    a child whose stderr was redirected elsewhere inherits the variable, so compare."""
    if not os.path.exists(JOURNAL_SOCKET):
        return False
    value = os.environ.get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
        return st.st_dev == int(dev) and st.st_ino == int(ino)
    except (OSError, ValueError, AttributeError):
        return False


def configure(level: int = logging.INFO) -> None:
    """Send the node's events to journald or stderr.  Idempotent: a second call
    replaces the handler instead of doubling every line."""
    handler: logging.Handler
    if _stderr_is_journal():
        from cysystemd.journal import JournaldLogHandler

        handler = JournaldLogHandler(identifier="kibotos-node")  # type: ignore[no-untyped-call]
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(LOGGER_NAME)
    for old in list(logger.handlers):
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
