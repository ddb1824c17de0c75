"""Guest readiness over QEMU's agent socket: connect, then wait for the agent's hello.

The protocol is `kibotos.guest` (docs/guest-protocol.md): its client retries the first
connect (QEMU creates the socket file before it listens), sends the resync preamble and
a ``hello_request``, and checks the guest's protocol version.  This module adds what
only the backend knows about: the guest console.  A guest that will never say hello
has usually printed why (``kibotos-init: FAILED: …``, a kernel panic), so the console
is watched while waiting, and such a line ends the wait at once instead of at the
deadline; on a timeout the error carries the console's last lines.
"""

from __future__ import annotations

import re
from pathlib import Path

import trio

from kibotos.errors import DeadlineExceeded, FailedPrecondition, KibotosError
from kibotos.guest import GuestInfo, connect_unix_with_retry, open_guest_channel

#: Console lines after which the guest cannot become ready.
FATAL_CONSOLE = re.compile(rb"kibotos-init: FAILED: [^\r\n]*|Kernel panic - [^\r\n]*")
CONSOLE_POLL = 0.2


def console_tail(console_log: Path, lines: int = 5) -> str:
    """The last `lines` lines of the guest console, joined with `` | ``."""
    try:
        with open(console_log, "rb") as f:
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


async def _watch_console(console_log: Path) -> str:
    """Return the first fatal line the console shows (polling; never returns if none)."""
    offset = 0
    carry = b""
    while True:
        chunk = _read_from(console_log, offset)
        if chunk:
            offset += len(chunk)
            window = carry + chunk
            m = FATAL_CONSOLE.search(window)
            if m:
                return m.group(0).decode("utf-8", "replace").strip()
            carry = window[-512:]
        await trio.sleep(CONSOLE_POLL)


def _kibotos_error(exc: BaseException) -> KibotosError | None:
    """`exc` itself, or the first KibotosError inside an exception group."""
    if isinstance(exc, KibotosError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _kibotos_error(inner)
            if found is not None:
                return found
    return None


async def wait_hello(agent_socket: Path, console_log: Path, deadline: float) -> GuestInfo:
    """The guest's hello by `deadline` (trio time); the connection is closed afterwards.

    Raises FailedPrecondition as soon as the console shows the guest cannot come up,
    DeadlineExceeded (with the console's tail) when it is not ready in time, and
    `GuestProtocolUnsupported` for a guest outside the accepted protocol versions."""
    result: GuestInfo | None = None
    error: KibotosError | None = None
    fatal: str | None = None

    async def hello(cancel: trio.CancelScope) -> None:
        # Errors are kept, not raised: a nursery would wrap them in an ExceptionGroup.
        nonlocal result, error
        try:
            stream = await connect_unix_with_retry(agent_socket, deadline)
            async with open_guest_channel(stream) as guest:
                result = await guest.wait_hello(deadline)
        except BaseException as exc:  # the client's own nursery wraps its errors
            error = _kibotos_error(exc)
            if error is None:
                raise
        cancel.cancel()

    async def watch(cancel: trio.CancelScope) -> None:
        nonlocal fatal
        fatal = await _watch_console(console_log)
        cancel.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hello, nursery.cancel_scope)
        nursery.start_soon(watch, nursery.cancel_scope)
    if result is not None:
        return result
    if fatal is None:
        # The channel broke or timed out: the console may say why (QEMU exits right
        # after the init powers off, often before the next poll).
        m = FATAL_CONSOLE.search(_read_from(console_log, 0)[-65536:])
        fatal = m.group(0).decode("utf-8", "replace").strip() if m else None
    if fatal is not None:
        raise FailedPrecondition(f"guest did not come up: {fatal}",
                                 details={"console_tail": console_tail(console_log)})
    if isinstance(error, DeadlineExceeded):
        tail = console_tail(console_log)
        raise DeadlineExceeded(
            error.message + (f"; guest console ends with: {tail}" if tail else ""))
    assert error is not None
    raise error
