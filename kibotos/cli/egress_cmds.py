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

import sys
from pathlib import Path

import click
import trio

from kibotos.cli.dataplane_cmds import _configure_logging
from kibotos.cli.numbers import AsciiFloat, AsciiInt
from kibotos.errors import KibotosError


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
    from kibotos.dataplane.groups import kibotos_leaf
    from kibotos.egress.serve import EgressSettings, serve_egress

    _configure_logging()
    settings = EgressSettings(socket_dir=socket_dir.absolute(), generation=generation)
    try:
        trio.run(serve_egress, settings)
    except KibotosError as exc:
        click.echo(f"egress process failed: {exc.message}", err=True)
        sys.exit(exc.exit_code)
    except BaseExceptionGroup as group:
        leaf = kibotos_leaf(group)
        if leaf is None:
            raise
        click.echo(f"egress process failed: {leaf.message}", err=True)
        sys.exit(leaf.exit_code)


def _run_for_node(config_path: Path, action: str, timeout: float) -> None:
    from kibotos import config as config_mod
    from kibotos.node.egress.units import list_units, stop_units
    from kibotos.node.instances.setup import supervisor_options
    from kibotos.plugins import load_plugins

    cfg = config_mod.load(config_mod.NodeConfig, config_path)
    regs = load_plugins(cfg.plugins.disable)
    supervisor = regs.supervisor.get(cfg.supervisor.backend)(supervisor_options(cfg))

    async def main() -> None:
        if action == "stop":
            for name in await stop_units(supervisor, cfg.node.socket_dir, timeout=timeout):
                click.echo(f"stopped {name}")
            return
        for info in await list_units(supervisor, cfg.node.socket_dir):
            state = f"running pid {info.main_pid}" if info.active else \
                f"ended ({info.result or 'unknown'})"
            click.echo(f"{info.name}  {state}")

    try:
        trio.run(main)
    except KibotosError as exc:
        click.echo(f"error: {exc.message}", err=True)
        sys.exit(exc.exit_code)


_config_option = click.option(
    "--config", "config_path", required=True,
    type=click.Path(dir_okay=False, path_type=Path), help="The node's node.toml.")


@egress_group.command("list")
@_config_option
def list_command(config_path: Path) -> None:
    """The node's egress units, oldest generation first."""
    _run_for_node(config_path, "list", 0.0)


@egress_group.command("stop")
@_config_option
@click.option("--timeout", default=5.0, type=AsciiFloat(min=0), show_default=True,
              metavar="SECONDS", help="Per process: how long before SIGKILL.")
def stop_command(config_path: Path, timeout: float) -> None:
    """End every egress process of the node (their connections drop; a running node
    starts a new one within seconds if a policy needs it)."""
    _run_for_node(config_path, "stop", timeout)
