"""``kibotos node …`` (also ``kibotos-node …``): the commands run on a node host.

Not to be confused with ``kibo node`` (operator commands about nodes, in node_cmds.py).
Exit statuses: 0 after a clean stop (SIGTERM/SIGINT), the error's exit code (10 for a
bad config, 13 for a failed start precondition) and 75 when ctrl said the node was
isolated, so that systemd restarts it with a new incarnation.
"""

from __future__ import annotations

import functools
import signal
import sys
from pathlib import Path
from typing import NoReturn

import click
import trio

from kibotos import config as config_mod
from kibotos.config import NodeConfig
from kibotos.core.errors import KibotosError


@click.group("node")
def node_role_group() -> None:
    """The node role: run this host as a kibotos node."""


def _fail(exc: KibotosError) -> NoReturn:
    click.echo(f"error: {exc.message}", err=True)
    sys.exit(exc.exit_code)


async def _run_until_signal(cfg: NodeConfig) -> None:
    """Run the node; SIGTERM or SIGINT cancel it, so the session closes cleanly and the
    owner lock is released before the process ends."""
    from kibotos.core.logs import EventLogger
    from kibotos.node.serve import serve_node

    log = EventLogger()
    async with trio.open_nursery() as nursery:

        async def watch_signals() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("node stopping", signal=signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(watch_signals)
        await serve_node(cfg, dataplane=True)
        nursery.cancel_scope.cancel()


@node_role_group.command("serve")
@click.option("--config", "config_path", required=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="The node's configuration file (node.toml).")
def serve_command(config_path: Path) -> None:
    """Run the node: enroll once, then hold the control session to ctrl."""
    try:
        cfg = config_mod.load(NodeConfig, config_path)
    except KibotosError as exc:
        _fail(exc)
    from kibotos.core import logs
    from kibotos.node.session.control import NodeIsolated

    logs.configure()
    try:
        trio.run(_run_until_signal, cfg)
    except BaseExceptionGroup as group:
        leaf: BaseException = group
        while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
            leaf = leaf.exceptions[0]
        if isinstance(leaf, KibotosError):
            _report_and_exit(leaf, NodeIsolated)
        raise
    except KibotosError as exc:
        _report_and_exit(exc, NodeIsolated)


def _report_and_exit(exc: KibotosError, isolated: type[KibotosError]) -> NoReturn:
    from kibotos.core.logs import EventLogger

    log = EventLogger()
    if isinstance(exc, isolated):
        log.error("node exiting after isolate", error=exc.message, exit_status=exc.exit_code)
    else:
        log.error("node failed", error=exc.message, code=exc.code, exit_status=exc.exit_code)
    sys.exit(exc.exit_code)


@node_role_group.group("storage-pool")
def storage_pool_group() -> None:
    """Storage pools on this host (spec: storage-pools-on-nfs)."""


@storage_pool_group.command("init")
@click.option("--id", "pool_id", required=True,
              help="The pool ID, as in [[storage.pool]] id.")
@click.option("--path", "path", required=True, type=click.Path(path_type=Path),
              help="The pool directory, as in [[storage.pool]] path (absolute).")
@click.option("--adopt", is_flag=True,
              help="Add the marker to a non-empty directory, keeping its data.")
def storage_pool_init_command(pool_id: str, path: Path, adopt: bool) -> None:
    """Write the pool marker that proves this directory is pool ID.

    Does not read the node configuration.  Creates a missing directory; refuses a
    non-empty one without --adopt; a second run with the same ID changes nothing; a
    directory initialized with another ID is refused and its marker kept."""
    from kibotos.node.storage.pools.marker import init_pool

    try:
        result = init_pool(pool_id, path, adopt=adopt)
    except KibotosError as exc:
        _fail(exc)
    state = "initialized" if result.created else "already initialized"
    click.echo(f"storage pool {result.marker.pool_id} {state} at {result.path} "
               f"(instance {result.marker.instance})")


def _print_report(report: object, title: str) -> NoReturn:
    """Print the report's lines, a summary, and exit with its status."""
    from kibotos.node.checks.check_report import BLOCKED, Report

    assert isinstance(report, Report)
    click.echo(report.render(), nl=False)
    blocked = len(report.of(BLOCKED))
    if blocked:
        click.echo(f"{title}: {blocked} blocking item(s)")
    else:
        click.echo(f"{title}: passed")
    sys.exit(report.exit_code)


@node_role_group.command("check-maintenance")
@click.option("--config", "config_path", required=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="The node's configuration file (node.toml).")
@click.option("--operation", required=True, type=click.Choice(["upgrade", "remove"]),
              help="upgrade: Instances may keep running; remove: nothing may remain.")
def check_maintenance_command(config_path: Path, operation: str) -> None:
    """Before replacing or removing the node binary, with the node service stopped: are
    this node's resources quiescent and owned?  Read-only (docs/upgrades.md).

    Prints ok:/blocked: lines; exits 0 when nothing blocks, 13 when something does, 10
    when the configuration cannot be read."""
    from kibotos.node.checks import maintenance_check

    try:
        cfg = config_mod.load(NodeConfig, config_path)
        report = trio.run(maintenance_check.run, cfg, operation)
    except KibotosError as exc:
        _fail(exc)
    _print_report(report, f"check-maintenance --operation {operation}")


@node_role_group.command("check-upgrade")
@click.option("--config", "config_path", required=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="The node's configuration file (node.toml).")
@click.option("--runtime-dir", required=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="The target version's runtime directory (extracted, not installed).")
@click.option("--preview", is_flag=True,
              help="Run on a live node: no owner lock, no quiescence rules.")
def check_upgrade_command(config_path: Path, runtime_dir: Path, preview: bool) -> None:
    """Run with the *target* version's binary: can it take over what is on disk and
    running?  Read-only (docs/upgrades.md).

    Prints ok:/blocked:/pending: lines; exits 0 when nothing blocks (pending lines do
    not count), 13 when something does, 10 when the configuration cannot be read."""
    from kibotos.node.checks import upgrade_check

    try:
        cfg = config_mod.load(NodeConfig, config_path)
        report = trio.run(functools.partial(upgrade_check.run, cfg, runtime_dir,
                                            preview=preview))
    except KibotosError as exc:
        _fail(exc)
    _print_report(report, "check-upgrade --preview" if preview else "check-upgrade")
