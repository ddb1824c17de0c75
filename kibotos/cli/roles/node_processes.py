"""What ``kibotos dataplane`` and ``kibotos egress`` share: a node-run process's
``serve`` (its logging and exit status) and ``list``/``stop`` of the node's units.

Both processes run as units the node starts through its supervisor plugin
(`kibotos.node.runtime.process_units`), so ``list`` and ``stop`` read the node's
``node.toml`` and ask that plugin (also with the ``direct`` supervisor, where
``systemctl`` sees nothing).  ``serve`` reads no configuration: everything comes on the
command line and over the control socket.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import trio

from kibotos.core.errors import KibotosError

if TYPE_CHECKING:
    from kibotos.backends import Supervisor, UnitInfo
    from kibotos.config import NodeConfig

config_option = click.option(
    "--config", "config_path", required=True,
    type=click.Path(dir_okay=False, path_type=Path), help="The node's node.toml.")


def configure_logging() -> None:
    """One event per line on stderr (the unit's journal, or the direct supervisor's
    log file)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("kibotos")
    for old in list(logger.handlers):
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def serve(main: Callable[[Any], Awaitable[Any]], settings: Any, what: str) -> None:
    """Run the process until it ends; a `KibotosError` (also inside a group) is one
    line ``<what> failed: …`` and its exit code."""
    from kibotos.dataplane.process.groups import kibotos_leaf

    configure_logging()
    try:
        trio.run(main, settings)
    except KibotosError as exc:
        click.echo(f"{what} failed: {exc.message}", err=True)
        sys.exit(exc.exit_code)
    except BaseExceptionGroup as group:
        leaf = kibotos_leaf(group)
        if leaf is None:
            raise
        click.echo(f"{what} failed: {leaf.message}", err=True)
        sys.exit(leaf.exit_code)


def node_supervisor(config_path: Path) -> tuple[NodeConfig, Supervisor]:
    """The node's configuration and its supervisor plugin."""
    from kibotos import config as config_mod
    from kibotos.node.instances.setup import supervisor_options
    from kibotos.plugins import load_plugins

    cfg = config_mod.load(config_mod.NodeConfig, config_path)
    regs = load_plugins(cfg.plugins.disable)
    return cfg, regs.supervisor.get(cfg.supervisor.backend)(supervisor_options(cfg))


def list_or_stop(units: Callable[[], Awaitable[list[UnitInfo]]],
                 stop: Callable[[], Awaitable[list[str]]], action: str) -> None:
    """``list`` (one line per unit) or ``stop`` (one line per unit stopped); an error is
    ``error: …`` and its exit code."""
    async def main() -> None:
        if action == "stop":
            for name in await stop():
                click.echo(f"stopped {name}")
            return
        for info in await units():
            state = f"running pid {info.main_pid}" if info.active else \
                f"ended ({info.result or 'unknown'})"
            click.echo(f"{info.name}  {state}")

    try:
        trio.run(main)
    except KibotosError as exc:
        click.echo(f"error: {exc.message}", err=True)
        sys.exit(exc.exit_code)
