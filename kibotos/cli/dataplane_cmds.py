"""``kibotos dataplane serve``: the data-plane process, as the node starts it.

The node runs it as the unit ``kibotos-dataplane-<scope>-<generation>`` (see
`kibotos.node.dataplane_supervisor`); running it by hand is for debugging.  It reads no
configuration file and never touches the node's state directory: everything it needs
comes on the command line and, afterwards, over its control socket.  Exit status 0
after a signal and the drain, the error's exit code when it cannot start (17 when the
listen address or the control socket cannot be bound).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click
import trio

from kibotos.errors import KibotosError


@click.group("dataplane")
def dataplane_group() -> None:
    """The data-plane process (started by the node)."""


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("kibotos")
    for old in list(logger.handlers):
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


@dataplane_group.command("serve")
@click.option("--listen", required=True, metavar="HOST:PORT",
              help="The data-plane address (the node's dataplane_listen).")
@click.option("--socket-dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The node's socket directory; the control socket is "
                   "<socket-dir>/dataplane/control.sock.")
@click.option("--generation", required=True, type=click.IntRange(min=1),
              help="This process's generation, as the node numbered it.")
@click.option("--drain-timeout", default=10.0, type=click.FloatRange(min=0), show_default=True,
              metavar="SECONDS", help="On SIGTERM, how long open connections may take to end.")
def serve_command(listen: str, socket_dir: Path, generation: int,
                  drain_timeout: float) -> None:
    """Serve exec for the node's Instances until SIGTERM."""
    from kibotos.dataplane.groups import kibotos_leaf
    from kibotos.dataplane.serve import DataplaneSettings, serve_dataplane

    _configure_logging()
    settings = DataplaneSettings(listen=listen, socket_dir=socket_dir.absolute(),
                                 generation=generation, drain_timeout=drain_timeout)
    try:
        trio.run(serve_dataplane, settings)
    except KibotosError as exc:
        click.echo(f"data plane failed: {exc.message}", err=True)
        sys.exit(exc.exit_code)
    except BaseExceptionGroup as group:
        leaf = kibotos_leaf(group)
        if leaf is None:
            raise
        click.echo(f"data plane failed: {leaf.message}", err=True)
        sys.exit(leaf.exit_code)
