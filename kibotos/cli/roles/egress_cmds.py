"""``kibotos egress serve|list|stop``: the egress process, and its units on a node.

``serve`` is the process as the node starts it, in the unit
``kibotos-egress-<scope>-<generation>`` as the user ``kibotos-egress`` (see
`kibotos.node.egress.supervisor`); it reads no configuration file and never touches
the node's state directory: its sockets, routes and credentials come over its control
socket.  Exit status 0 after a drain or a signal, the error's exit code when it cannot
start.

``list`` and ``stop`` take the node's ``node.toml`` and work through the node's
supervisor plugin, so they see the units the node started (also with the ``direct``
supervisor, where ``systemctl`` sees nothing).
"""

from __future__ import annotations

from pathlib import Path

import click

from kibotos.cli.core.numbers import AsciiFloat, AsciiInt
from kibotos.cli.roles.node_processes import config_option, list_or_stop, node_supervisor, serve


@click.group("egress")
def egress_group() -> None:
    """The egress process (started by the node)."""


@egress_group.command("serve")
@click.option("--socket-dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The egress socket directory (<node socket dir>-egress, mode 0700, owned "
                   "by this process's user), where it binds control-<generation>.sock.")
@click.option("--generation", required=True, type=AsciiInt(min=1),
              help="This process's generation, as the node numbered it.")
def serve_command(socket_dir: Path, generation: int) -> None:
    """Forward guest TCP through SOCKS5 Egresses and DNS to Resolvers until drained."""
    from kibotos.egress.serve import EgressSettings, serve_egress

    serve(serve_egress, EgressSettings(socket_dir=socket_dir.absolute(),
                                       generation=generation), "egress process")


def _run_for_node(config_path: Path, action: str, timeout: float) -> None:
    from kibotos.node.egress.units import list_units, stop_units

    cfg, supervisor = node_supervisor(config_path)
    socket_dir = cfg.node.socket_dir
    list_or_stop(lambda: list_units(supervisor, socket_dir),
                 lambda: stop_units(supervisor, socket_dir, timeout=timeout), action)


@egress_group.command("list")
@config_option
def list_command(config_path: Path) -> None:
    """The node's egress units, oldest generation first."""
    _run_for_node(config_path, "list", 0.0)


@egress_group.command("stop")
@config_option
@click.option("--timeout", default=5.0, type=AsciiFloat(min=0), show_default=True,
              metavar="SECONDS", help="Per process: how long before SIGKILL.")
def stop_command(config_path: Path, timeout: float) -> None:
    """End every egress process of the node (their connections drop; a running node
    starts a new one within seconds if a policy needs it)."""
    _run_for_node(config_path, "stop", timeout)
