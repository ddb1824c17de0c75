"""The node's log lines: ``message key=value …``, to stderr unless stderr is the journal."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from kibotos.core.logs import format_event


def test_format_event() -> None:
    assert format_event("session up", {}) == "session up"
    line = format_event("control session down", {
        "reason": "rejected: not_admitted", "retry_in": "60.0s", "count": 3, "tight": False,
        "since": None, "empty": "", "quote": 'a"b', "eq": "a=b"})
    assert line == ('control session down reason="rejected: not_admitted" retry_in=60.0s '
                    'count=3 tight=false since=- empty="" quote="a\\"b" eq="a=b"')


def test_configure_writes_one_line_per_event_to_stderr() -> None:
    code = ("from kibotos.core import logs\n"
            "logs.configure()\nlogs.configure()\n"  # idempotent: no doubled lines
            "logs.EventLogger().warning('memory tight', available_bytes=10)\n"
            "logs.EventLogger().debug('not shown')\n")
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60, env=env)
    assert proc.stderr == "memory tight available_bytes=10\n"
    assert proc.stdout == ""
    assert logging.getLogger("kibotos.node").propagate  # this process was not configured
