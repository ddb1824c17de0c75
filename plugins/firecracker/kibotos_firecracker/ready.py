"""Guest readiness over vsock: the agent's hello, while watching the guest console.

Firecracker writes the guest's serial console to its own stdout, which is the unit's
``vmm.log``.  A guest that will never say hello has usually printed why there
(``kibotos-init: FAILED: …``, a kernel panic), so the log is watched while waiting and
such a line ends the wait at once; a timeout carries the log's last lines.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from kibotos.errors import DeadlineExceeded, FailedPrecondition, KibotosError
from kibotos.guest import GuestInfo, open_guest_channel

#: Console lines after which the guest cannot become ready.
FATAL_CONSOLE = re.compile(rb"kibotos-init: FAILED: [^\r\n]*|Kernel panic - [^\r\n]*")
_POLL = 0.2


def log_tail(path: Path, lines: int = 5) -> str:
    """The last `lines` lines of `path`, joined with `` | ``."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def _read_from(path: Path, offset: int) -> bytes:
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
        await trio.sleep(_POLL)


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
                     deadline: float) -> GuestInfo:
    """Connect (`connect` retries until `deadline` itself), open a guest session, and
    return the hello; the session is closed afterwards.

    FailedPrecondition as soon as the console shows the guest cannot come up,
    DeadlineExceeded (with the log's tail) when it is not ready in time."""
    result: GuestInfo | None = None
    error: KibotosError | None = None
    fatal: str | None = None

    async def hello(cancel: trio.CancelScope) -> None:
        nonlocal result, error
        try:
            stream = await connect()
            async with open_guest_channel(stream) as guest:
                result = await guest.wait_hello(deadline)
        except BaseException as exc:  # the client's nursery wraps its errors
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
        m = FATAL_CONSOLE.search(_read_from(log, 0)[-65536:])
        fatal = m.group(0).decode("utf-8", "replace").strip() if m else None
    if fatal is not None:
        raise FailedPrecondition(f"guest did not come up: {fatal}",
                                 details={"console_tail": log_tail(log)})
    if isinstance(error, DeadlineExceeded):
        tail = log_tail(log)
        raise DeadlineExceeded(error.message + (f"; vmm.log ends with: {tail}" if tail else ""))
    assert error is not None
    raise error
