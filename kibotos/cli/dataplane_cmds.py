"""``kibotos dataplane serve|list|stop``: the data-plane process, and its units on a node.

``serve`` is the process, as the node starts it in the unit
``kibotos-dataplane-<scope>-<generation>`` (see `kibotos.node.dataplane.supervisor`);
running it by hand is for debugging.  It reads no configuration file and never touches
the node's state directory: everything it needs comes on the command line and,
afterwards, over its control socket.  Exit status 0 after a signal and the drain, the
error's exit code when it cannot start (17 when the listen address or the control socket
cannot be bound).

``list`` and ``stop`` take the node's ``node.toml`` and work through the node's
supervisor plugin, so they see the units the node started (also with the ``direct``
supervisor, where ``systemctl`` sees nothing).  ``stop`` is how to cut off data-plane
access at once; the node starts a new process when it next runs (or within seconds,
if it is running).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
import trio

from kibotos.cli.numbers import AsciiFloat, AsciiInt
from kibotos.errors import KibotosError

if TYPE_CHECKING:
    from kibotos.node.dataplane.supervisor import DataplaneSupervisor


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
@click.option("--generation", required=True, type=AsciiInt(min=1),
              help="This process's generation, as the node numbered it.")
@click.option("--drain-timeout", default=10.0, type=AsciiFloat(min=0), show_default=True,
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


def _node_dataplane(config_path: Path) -> DataplaneSupervisor:
    from kibotos import config as config_mod
    from kibotos.node.dataplane.supervisor import DataplaneSupervisor
    from kibotos.node.instances.setup import supervisor_options
    from kibotos.plugins import load_plugins

    cfg = config_mod.load(config_mod.NodeConfig, config_path)
    regs = load_plugins(cfg.plugins.disable)
    supervisor = regs.supervisor.get(cfg.supervisor.backend)(supervisor_options(cfg))
    return DataplaneSupervisor(node_id=cfg.node.id, listen=cfg.node.dataplane_listen,
                               socket_dir=cfg.node.socket_dir,
                               state_dir=cfg.storage.root / "state", supervisor=supervisor)


def _run_for_node(config_path: Path, action: str, timeout: float) -> None:
    async def main() -> None:
        dp = _node_dataplane(config_path)
        if action == "stop":
            for name in await dp.stop_all(timeout=timeout):
                click.echo(f"stopped {name}")
            return
        for info in await dp.units():
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


@dataplane_group.command("list")
@_config_option
def list_command(config_path: Path) -> None:
    """The node's data-plane units, oldest generation first."""
    _run_for_node(config_path, "list", 0.0)


@dataplane_group.command("stop")
@_config_option
@click.option("--timeout", default=15.0, type=AsciiFloat(min=0), show_default=True,
              metavar="SECONDS", help="Per process: how long before SIGKILL (it drains "
                                      "its connections for 10 s first).")
def stop_command(config_path: Path, timeout: float) -> None:
    """End every data-plane process of the node (cuts off exec at once)."""
    _run_for_node(config_path, "stop", timeout)
