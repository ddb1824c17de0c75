"""The three flows of ``kibo workspace exec`` in one thread: stdin up, output down,
signals and window changes across.

One `select.poll` loop over the data-plane socket, local stdin and a signal wake-up
pipe (`signal.set_wakeup_fd`), on `kibotos.dataplane.clients.exec_blocking`: no trio, whose
import alone was slower than the 0.25 s a whole ``kibo`` command may take.  poll, not
epoll, because stdin may be a regular file or ``/dev/null``, which epoll refuses.

* stdin is read only while less than `STDIN_BACKLOG` bytes wait for the data plane, so
  a fast local file is sent at the data plane's pace and never held whole in memory;
  local EOF sends ``eof``;
* output is written to stdout or stderr as it arrives (blocking: a slow reader slows
  the remote process down, end to end);
* without a terminal, SIGINT, SIGTERM, SIGHUP and SIGQUIT received by kibo are sent to
  the process group, and the third SIGINT leaves at once (the data plane then hangs
  the process up); with one, SIGWINCH resizes the remote terminal.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kibotos.core.errors import DeadlineExceeded, Unavailable
from kibotos.dataplane.clients import exec_blocking
from kibotos.dataplane.clients.exec_wire import ExecRequest, Output

if TYPE_CHECKING:  # for a wss:// data plane only
    import ssl

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
#: Ctrl-C this many times and kibo stops waiting for a process that ignores it.
INTERRUPTS_TO_LEAVE = 3
#: Stop reading stdin while this many bytes wait to be sent.
STDIN_BACKLOG = 1 << 20
#: How long the data plane may take to accept the connection and the upgrade.
CONNECT_TIMEOUT = 30.0
_IN = select.POLLIN | select.POLLPRI
_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL


class GlobalDeadline(DeadlineExceeded):
    """The invocation's ``--timeout`` passed while the command ran."""


def window_size(fds: tuple[int, ...]) -> tuple[int, int]:
    for fd in fds:
        with contextlib.suppress(OSError):
            size = os.get_terminal_size(fd)
            if size.lines > 0 and size.columns > 0:
                return size.lines, size.columns
    return 24, 80


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:  # an inherited non-blocking descriptor: wait for room
            select.select([], [fd], [])


@contextlib.contextmanager
def signal_pipe(signals: tuple[signal.Signals, ...]) -> Iterator[int]:
    """While inside, `signals` do nothing but write their numbers to the pipe whose
    read end is yielded; the previous handlers are back afterwards."""
    read_fd, write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    previous = {s: signal.getsignal(s) for s in signals}
    old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    try:
        for s in signals:
            signal.signal(s, lambda _signum, _frame: None)
        yield read_fd
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(old_fd)
        os.close(read_fd)
        os.close(write_fd)


def relay(url: str, credential: str, argv: tuple[str, ...], *, env: dict[str, str],
          cwd: str | None, tty: bool, timeout: float | None, stdin_fd: int = 0,
          stdout_fd: int = 1, stderr_fd: int = 2,
          ssl_context: ssl.SSLContext | None = None, user: str | None = None) -> int:
    """Run `argv` through the data plane at `url`, wired to the given descriptors;
    returns the exit status the shell would report (code, or 128 + signal).  After
    `timeout` seconds (None: never) it hangs up and raises `GlobalDeadline`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    rows, cols = window_size((stdout_fd, stdin_fd)) if tty else (24, 80)
    request = ExecRequest(argv, env, cwd, tty, rows, cols, user)
    connect_timeout = CONNECT_TIMEOUT if timeout is None else min(CONNECT_TIMEOUT, timeout)
    try:
        ex = exec_blocking.connect(url, credential, request, connect_timeout=connect_timeout,
                                   ssl_context=ssl_context)
    except DeadlineExceeded:
        if timeout is not None and timeout <= CONNECT_TIMEOUT:
            raise GlobalDeadline("") from None
        raise
    try:
        with signal_pipe((signal.SIGWINCH,) if tty else FORWARDED_SIGNALS) as signals:
            return _loop(ex, deadline, signals, stdin_fd, stdout_fd, stderr_fd, tty)
    finally:
        ex.close()


def _loop(ex: exec_blocking.BlockingExec, deadline: float | None, signals: int,
          stdin_fd: int, stdout_fd: int, stderr_fd: int, tty: bool) -> int:
    poller = select.poll()
    poller.register(signals, _IN)
    stdin_open = True
    stdin_polled = False
    interrupts = 0
    sock = ex.fileno()
    while ex.exit is None:
        ex.check_open()
        poller.register(sock, _IN | (select.POLLOUT if ex.wants_write else 0))
        want_stdin = stdin_open and ex.backlog < STDIN_BACKLOG
        if want_stdin != stdin_polled:
            if want_stdin:
                poller.register(stdin_fd, _IN)
            else:
                poller.unregister(stdin_fd)
            stdin_polled = want_stdin
        wait = None
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GlobalDeadline("")
            wait = max(1, int(left * 1000))
        ready = poller.poll(0 if ex.has_pending else wait)
        if ex.has_pending and not any(fd == sock for fd, _ in ready):
            ready.append((sock, select.POLLIN))
        for fd, flags in ready:
            if fd == sock:
                if flags & select.POLLOUT:
                    ex.flush()
                if flags & (_IN | _GONE):
                    for event in ex.receive():
                        if isinstance(event, Output):
                            write_all(stderr_fd if event.stream == 2 else stdout_fd,
                                      event.data)
            elif fd == stdin_fd and stdin_polled:
                data = _read_stdin(stdin_fd, flags)
                if data is None:
                    continue
                with contextlib.suppress(Unavailable):  # the reader says why it closed
                    if data:
                        ex.send_stdin(data)
                    else:
                        ex.close_stdin()
                if not data:
                    stdin_open = stdin_polled = False
                    poller.unregister(stdin_fd)
            elif fd == signals:
                for signum in _drain(signals):
                    if signum == signal.SIGWINCH:
                        with contextlib.suppress(Unavailable):
                            ex.resize(*window_size((stdout_fd, stdin_fd)))
                        continue
                    if tty:
                        continue
                    with contextlib.suppress(Unavailable):
                        ex.signal(signal.Signals(signum).name.removeprefix("SIG"))
                    interrupts += signum == signal.SIGINT
                    if interrupts >= INTERRUPTS_TO_LEAVE:
                        # Left after repeated interrupts: the process is hung up.
                        return 128 + signal.SIGINT
        ex.flush()
    return ex.exit.returncode


def _read_stdin(fd: int, flags: int) -> bytes | None:
    """What stdin has now (None: nothing after all); b"" at its end, and also when it
    is unusable (closed, a hung-up terminal), which for the remote process is the same."""
    if flags & select.POLLNVAL:
        return b""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:  # an inherited non-blocking descriptor woke us for nothing
        return b"" if flags & _GONE else None
    except OSError as exc:
        if exc.errno in (errno.EIO, errno.EBADF):
            return b""
        raise


def _drain(fd: int) -> list[int]:
    numbers: list[int] = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 64):
            numbers.extend(chunk)
    return numbers
