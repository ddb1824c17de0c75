"""``kibo workspace exec WS [--tty] [--env K=V] [--cwd DIR] [--user NAME] -- CMD…``: run a
command in a Workspace, streaming its input and output; exit with its exit code.

It asks ctrl for a session credential (``POST /v1/workspaces/{id}/sessions``), then
connects to the Workspace node's data plane and runs the command there
(docs/dataplane.md).  The client end is `kibotos.dataplane.clients.exec_blocking` (a socket
and `kibotos.dataplane.clients.ws_client`) driven by the one-thread poll loop of
`kibotos.cli.workspace.exec_relay`, not the trio client the data plane's tests and services use:
trio's import alone took longer than a whole ``kibo`` command may (issue 14: 0.25 s).
Both clients read the protocol through `kibotos.dataplane.clients.exec_wire`.

Exit status: the command's exit code, ``128 + N`` when it was killed by signal N (the
shell's convention), or the kibo error codes of docs/cli.md when it did not run to the
end (12 no such Workspace, 13 not AVAILABLE, 17 data plane unreachable or the connection
dropped, 16 the global ``--timeout`` passed).

Without ``--tty`` the process gets pipes: stdout and stderr stay apart, local EOF on
stdin closes its stdin, and SIGINT, SIGTERM, SIGHUP and SIGQUIT received by kibo are
sent to its process group (a third Ctrl-C leaves at once, hanging it up).  With
``--tty`` it gets a terminal of the local window's size, kibo's terminal is put in raw
mode (every key goes to the remote side, Ctrl-C included) and restored on exit, and
window changes (SIGWINCH) resize the remote terminal.  ``--user`` runs it as that user
of the guest (its ids, groups, HOME, and its home as the working directory); without
it, as the guest agent's user, root.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import click

from kibotos.cli.core.options import Invocation, kibo_options
from kibotos.core import ids
from kibotos.core.errors import DeadlineExceeded, InvalidArgument

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def parse_env(pairs: tuple[str, ...]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not _ENV_NAME.fullmatch(name):
            raise InvalidArgument(f"--env {pair!r}: expected NAME=VALUE with a variable name "
                                  "of letters, digits and underscores")
        env[name] = value
    return env


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


@click.command("exec")
@click.argument("workspace")
@click.argument("command", nargs=-1, required=True, metavar="-- CMD [ARG]...")
@click.option("--tty", "-t", is_flag=True, help="Give the command a terminal (raw mode "
              "locally, window size and changes passed on).")
@click.option("--env", "-e", "env_pairs", multiple=True, metavar="NAME=VALUE",
              help="Set an environment variable for the command (repeatable).")
@click.option("--cwd", metavar="DIR", help="Working directory (absolute) in the Workspace "
              "(default: the user's home).")
@click.option("--user", "-u", metavar="NAME", help="Run as this user of the guest "
              "(its uid, groups and HOME; default: the guest agent's user, root).")
@kibo_options
def exec_command(inv: Invocation, workspace: str, command: tuple[str, ...], tty: bool,
                 env_pairs: tuple[str, ...], cwd: str | None, user: str | None) -> None:
    """Run CMD in the AVAILABLE Workspace WORKSPACE; exit with its exit code.

    \b
    kibo workspace exec ws-01k… -- uname -a
    kibo workspace exec ws-01k… --tty -- bash
    echo hi | kibo workspace exec ws-01k… --env LANG=C.UTF-8 -- cat
    kibo workspace exec ws-01k… --user www-data -- id
    """
    from kibotos.dataplane.clients.user_name import optional_user_name

    ids.check_object_id(workspace, "workspace ID")
    optional_user_name(user, "--user")
    env = parse_env(env_pairs)
    if cwd is not None and not cwd.startswith("/"):
        raise InvalidArgument(f"--cwd {cwd!r} must be an absolute path")
    if tty and "TERM" not in env and os.environ.get("TERM"):
        env["TERM"] = os.environ["TERM"]
    from kibotos.cli.workspace.exec_relay import (  # not for the rest of `workspace`
        GlobalDeadline,
        relay,
    )

    session: dict[str, Any] = inv.client().post(
        f"/v1/workspaces/{workspace}/sessions", {"operations": ["exec"]}, write=False)
    raw = tty and os.isatty(0)
    try:
        with raw_terminal(0) if raw else contextlib.nullcontext():
            code = relay(session["dataplane_url"], session["credential"], command,
                         env=env, cwd=cwd, tty=tty, timeout=inv.deadline.remaining(),
                         user=user,
                         ssl_context=inv.dataplane_tls(session["dataplane_url"]))
    except GlobalDeadline:
        raise DeadlineExceeded(f"the global --timeout of {inv.deadline.seconds:g}s passed; "
                               "the command was hung up") from None
    sys.stdout.flush()
    raise click.exceptions.Exit(code)
