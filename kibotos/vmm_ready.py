"""Waiting for a guest's hello while watching its console (public plugin API).

Every VMM backend that boots a kibotos Platform waits the same way once it has a byte
stream to the guest agent (`kibotos.guest`): open a session and wait for the hello.
A guest that will never say hello has usually printed why on its console
(``kibotos-init: FAILED: …``, a kernel panic), so the console log is watched while
waiting and such a line ends the wait at once instead of at the deadline; on a timeout
the error carries the log's last lines.  Backends differ only in how they connect and
which file holds the console, so those are the arguments.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from kibotos.core.errors import DeadlineExceeded, FailedPrecondition, KibotosError
from kibotos.guest import GuestInfo, open_guest_channel

#: Console lines after which the guest cannot become ready.
FATAL_CONSOLE = re.compile(rb"kibotos-init: FAILED: [^\r\n]*|Kernel panic - [^\r\n]*")
#: How often the console log is read while waiting (seconds).
CONSOLE_POLL = 0.2


def log_tail(path: Path, lines: int = 5) -> str:
    """The last `lines` lines of the log at `path`, joined with `` | `` ("" if unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def _read_from(path: Path, offset: int) -> bytes:
    """What `path` holds past `offset` (a small local file: read in place, no thread)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return b""


async def watch_console(log: Path) -> str:
    """The first fatal line `log` shows (polling; never returns if there is none)."""
    offset = 0
    carry = b""
    while True:
        chunk = _read_from(log, offset)
        if chunk:
            offset += len(chunk)
            window = carry + chunk
            m = FATAL_CONSOLE.search(window)
            if m:
                return m.group(0).decode("utf-8", "replace").strip()
            carry = window[-512:]
        await trio.sleep(CONSOLE_POLL)


def first_kibotos_error(exc: BaseException) -> KibotosError | None:
    """`exc` itself, or the first KibotosError inside an exception group."""
    if isinstance(exc, KibotosError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = first_kibotos_error(inner)
            if found is not None:
                return found
    return None


async def wait_hello(connect: Callable[[], Awaitable[trio.abc.Stream]], log: Path,
                     deadline: float, *, log_name: str) -> GuestInfo:
    """The guest's hello by `deadline` (trio time): `connect` (which retries until
    `deadline` itself) gives the stream, a guest session is opened on it and closed
    afterwards, while the console `log` is watched.

    Raises FailedPrecondition as soon as the console shows the guest cannot come up,
    DeadlineExceeded (its message ending with ``; <log_name> ends with: <tail>``) when
    it is not ready in time, and `GuestProtocolUnsupported` for a guest outside the
    accepted protocol versions."""
    result: GuestInfo | None = None
    error: KibotosError | None = None
    fatal: str | None = None

    async def hello(cancel: trio.CancelScope) -> None:
        # Errors are kept, not raised: a nursery would wrap them in an ExceptionGroup.
        nonlocal result, error
        try:
            stream = await connect()
            async with open_guest_channel(stream) as guest:
                result = await guest.wait_hello(deadline)
        except BaseException as exc:  # the client's own nursery wraps its errors
            error = first_kibotos_error(exc)
            if error is None:
                raise
        cancel.cancel()

    async def watch(cancel: trio.CancelScope) -> None:
        nonlocal fatal
        fatal = await watch_console(log)
        cancel.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hello, nursery.cancel_scope)
        nursery.start_soon(watch, nursery.cancel_scope)
    if result is not None:
        return result
    if fatal is None:
        # The channel broke or timed out: the console may say why (the VMM exits right
        # after the init powers off, often before the next poll).
        m = FATAL_CONSOLE.search(_read_from(log, 0)[-65536:])
        fatal = m.group(0).decode("utf-8", "replace").strip() if m else None
    if fatal is not None:
        raise FailedPrecondition(f"guest did not come up: {fatal}",
                                 details={"console_tail": log_tail(log)})
    if isinstance(error, DeadlineExceeded):
        tail = log_tail(log)
        raise DeadlineExceeded(
            error.message + (f"; {log_name} ends with: {tail}" if tail else ""))
    assert error is not None
    raise error
