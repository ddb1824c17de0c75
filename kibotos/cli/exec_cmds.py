"""``kibo workspace exec WS [--tty] [--env K=V] [--cwd DIR] -- CMD…``: run a command in a
Workspace, streaming its input and output; exit with its exit code.

It asks ctrl for a session credential (``POST /v1/workspaces/{id}/sessions``), then
connects to the Workspace node's data plane and runs the command there
(`kibotos.dataplane.client`, docs/dataplane.md).  The WebSocket client is trio-websocket,
the library the node's control session already uses: httpx has no WebSocket support,
and trio lets the three flows (stdin up, output down, signals and window changes) run
as tasks with one cancellation story instead of threads.

Exit status: the command's exit code, ``128 + N`` when it was killed by signal N (the
shell's convention), or the kibo error codes of docs/cli.md when it did not run to the
end (12 no such Workspace, 13 not AVAILABLE, 17 data plane unreachable or the connection
dropped, 16 the global ``--timeout`` passed).

Without ``--tty`` the process gets pipes: stdout and stderr stay apart, local EOF on
stdin closes its stdin, and SIGINT, SIGTERM, SIGHUP and SIGQUIT received by kibo are
sent to its process group (a third Ctrl-C leaves at once, hanging it up).  With
``--tty`` it gets a terminal of the local window's size, kibo's terminal is put in raw
mode (every key goes to the remote side, Ctrl-C included) and restored on exit, and
window changes (SIGWINCH) resize the remote terminal.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click

from kibotos import ids
from kibotos.cli.options import Invocation, kibo_options
from kibotos.errors import DeadlineExceeded, InvalidArgument, Unavailable

if TYPE_CHECKING:  # trio is imported when a command runs: `kibo workspace --help` stays fast
    import trio

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
#: Ctrl-C this many times and kibo stops waiting for a process that ignores it.
INTERRUPTS_TO_LEAVE = 3


def parse_env(pairs: tuple[str, ...]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not _ENV_NAME.fullmatch(name):
            raise InvalidArgument(f"--env {pair!r}: expected NAME=VALUE with a variable name "
                                  "of letters, digits and underscores")
        env[name] = value
    return env


def _window_size(fds: tuple[int, ...]) -> tuple[int, int]:
    for fd in fds:
        with contextlib.suppress(OSError):
            size = os.get_terminal_size(fd)
            if size.lines > 0 and size.columns > 0:
                return size.lines, size.columns
    return 24, 80


@contextlib.contextmanager
def raw_terminal(fd: int) -> Iterator[None]:
    """The local terminal in raw mode for the block, restored whatever happens."""
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


async def relay(url: str, credential: str, argv: tuple[str, ...], *, env: dict[str, str],
                cwd: str | None, tty: bool, stdin_fd: int = 0, stdout_fd: int = 1,
                stderr_fd: int = 2, handle_signals: bool = True) -> int:
    """Run `argv` through the data plane at `url`, wired to the given descriptors;
    returns the exit status the shell would report (code, or 128 + signal)."""
    import trio

    from kibotos.dataplane.client import ExecClient, Output, open_exec
    from kibotos.dataplane.exec_session import ExecRequest

    rows, cols = _window_size((stdout_fd, stdin_fd)) if tty else (24, 80)
    request = ExecRequest(argv, env, cwd, tty, rows, cols)

    async def pump_stdin(ex: ExecClient) -> None:
        # A send that finds the connection closed is not this task's to report: the
        # process may have exited first (the exit is on its way), and if the connection
        # broke, reading the events says so.
        with contextlib.suppress(Unavailable):
            while True:
                data = await trio.to_thread.run_sync(os.read, stdin_fd, 65536,
                                                     abandon_on_cancel=True)
                if not data:
                    await ex.close_stdin()
                    return
                await ex.send_stdin(data)

    async def watch_signals(ex: ExecClient, leave: trio.CancelScope) -> None:
        wanted = (signal.SIGWINCH,) if tty else FORWARDED_SIGNALS
        interrupts = 0
        with trio.open_signal_receiver(*wanted) as received, \
                contextlib.suppress(Unavailable):
            async for signum in received:
                if signum == signal.SIGWINCH:
                    await ex.resize(*_window_size((stdout_fd, stdin_fd)))
                    continue
                await ex.signal(signal.Signals(signum).name.removeprefix("SIG"))
                interrupts += signum == signal.SIGINT
                if interrupts >= INTERRUPTS_TO_LEAVE:
                    leave.cancel()

    async with open_exec(url, credential, request) as ex:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump_stdin, ex)
            if handle_signals:
                nursery.start_soon(watch_signals, ex, nursery.cancel_scope)
            async for event in ex.events():
                if isinstance(event, Output):
                    fd = stderr_fd if event.stream == 2 else stdout_fd
                    await trio.to_thread.run_sync(_write_all, fd, event.data)
            nursery.cancel_scope.cancel()
        if ex.exit is None:  # left after repeated interrupts: the process is hung up
            return 128 + signal.SIGINT
        return ex.exit.returncode


@click.command("exec")
@click.argument("workspace")
@click.argument("command", nargs=-1, required=True, metavar="-- CMD [ARG]...")
@click.option("--tty", "-t", is_flag=True, help="Give the command a terminal (raw mode "
              "locally, window size and changes passed on).")
@click.option("--env", "-e", "env_pairs", multiple=True, metavar="NAME=VALUE",
              help="Set an environment variable for the command (repeatable).")
@click.option("--cwd", metavar="DIR", help="Working directory (absolute) in the Workspace.")
@kibo_options
def exec_command(inv: Invocation, workspace: str, command: tuple[str, ...], tty: bool,
                 env_pairs: tuple[str, ...], cwd: str | None) -> None:
    """Run CMD in the AVAILABLE Workspace WORKSPACE; exit with its exit code.

    \b
    kibo workspace exec ws-01k… -- uname -a
    kibo workspace exec ws-01k… --tty -- bash
    echo hi | kibo workspace exec ws-01k… --env LANG=C.UTF-8 -- cat
    """
    ids.check_object_id(workspace, "workspace ID")
    env = parse_env(env_pairs)
    if cwd is not None and not cwd.startswith("/"):
        raise InvalidArgument(f"--cwd {cwd!r} must be an absolute path")
    if tty and "TERM" not in env and os.environ.get("TERM"):
        env["TERM"] = os.environ["TERM"]
    session: dict[str, Any] = inv.client().post(
        f"/v1/workspaces/{workspace}/sessions", {"operations": ["exec"]}, write=False)
    raw = tty and os.isatty(0)
    remaining = inv.deadline.remaining()

    import trio

    async def main() -> int:
        with trio.move_on_after(remaining if remaining is not None else float("inf")):
            return await relay(session["dataplane_url"], session["credential"], command,
                               env=env, cwd=cwd, tty=tty)
        raise DeadlineExceeded(f"the global --timeout of {inv.deadline.seconds:g}s passed; "
                               "the command was hung up")

    with raw_terminal(0) if raw else contextlib.nullcontext():
        code = _run(main)
    sys.stdout.flush()
    raise click.exceptions.Exit(code)


def _run(main: Any) -> int:
    """trio.run, with the one error of a failed exec taken out of trio's groups."""
    import trio

    from kibotos.dataplane.groups import sole_error

    try:
        return int(trio.run(main))
    except BaseExceptionGroup as group:
        leaf = sole_error(group)
        if leaf is None:
            raise
        raise leaf from None
