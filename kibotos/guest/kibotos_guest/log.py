"""The agent's log: one line per event on stderr (the guest console).

A stand-in for `logging`, which imports threading, traceback, weakref, string and more
at start; in a TCG guest that was a tenth of a second before the first hello.  The line
format is the one the agent had with `logging`:
``2024-05-01 12:00:00,123 kibotos-guest INFO message``.
"""

from __future__ import annotations

import sys
import time

LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}


class Logger:
    """`logging.Logger`'s calling convention (``msg % args``, ``exc_info``), nothing else."""

    def __init__(self) -> None:
        self.level = LEVELS["INFO"]

    def set_level(self, name: str) -> None:
        """Raises ValueError naming the level when it is not one of `LEVELS`."""
        level = LEVELS.get(name.upper())
        if level is None:
            raise ValueError(f"unknown log level {name!r} (one of {', '.join(LEVELS)})")
        self.level = level

    def debug(self, msg: str, *args: object) -> None:
        self._emit(10, msg, args)

    def info(self, msg: str, *args: object) -> None:
        self._emit(20, msg, args)

    def warning(self, msg: str, *args: object) -> None:
        self._emit(30, msg, args)

    def error(self, msg: str, *args: object, exc_info: BaseException | None = None) -> None:
        self._emit(40, msg, args, exc_info)

    def exception(self, msg: str, *args: object) -> None:
        """An error with the traceback of the exception being handled."""
        self._emit(40, msg, args, sys.exc_info()[1])

    def _emit(self, level: int, msg: str, args: tuple[object, ...],
              exc: BaseException | None = None) -> None:
        if level < self.level:
            return
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        name = next(k for k, v in LEVELS.items() if v == level)
        try:
            text = msg % args if args else msg
        except (TypeError, ValueError):
            text = f"{msg} {args!r}"
        line = f"{stamp},{int(now * 1000) % 1000:03d} kibotos-guest {name} {text}\n"
        if exc is not None:
            import traceback  # only when there is one to print

            line += "".join(traceback.format_exception(exc))
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):
            return  # no console (or none at all): the agent must keep serving regardless


log = Logger()
