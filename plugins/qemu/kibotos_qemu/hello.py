"""Read the guest agent's hello from a freshly connected agent channel.

The frame format belongs to the guest protocol (`kibotos.guest.client`, documented in
docs/guest-protocol.md); this module only adds what the backend knows: the deadline,
and the guest console's last lines in the error, because a guest that never says hello
usually printed why (``kibotos-init: FAILED: …``, a kernel panic) on its console.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio

from kibotos.errors import DeadlineExceeded, FailedPrecondition


def console_tail(console_log: Path, lines: int = 5) -> str:
    try:
        with open(console_log, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 8192))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


async def read_hello(stream: trio.abc.Stream, *, deadline: float, console_log: Path
                     ) -> Mapping[str, Any]:
    try:
        client = importlib.import_module("kibotos.guest.client")
    except ImportError:
        raise FailedPrecondition("qemu backend: the guest client (kibotos.guest.client) "
                                 "is not installed") from None
    with trio.move_on_at(deadline):
        hello: Mapping[str, Any] = await client.read_hello(stream)
        return hello
    tail = console_tail(console_log)
    raise DeadlineExceeded(
        "guest agent did not say hello before the deadline"
        + (f"; guest console ends with: {tail}" if tail else ""))
