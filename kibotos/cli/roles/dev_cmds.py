"""``kibotos dev cluster up|down|status``: a whole cluster on this machine, on loopback.

A thin shell over `kibotos.dev.DevCluster`: options in, progress on stderr, the
``export KIBO_CONFIG=…`` line and tables on stdout, errors through the CLI's renderer
with the exit code of their class.
"""

from __future__ import annotations

import functools
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from kibotos.cli.core.numbers import AsciiInt
from kibotos.cli.core.output import Output
from kibotos.core.errors import KibotosError
from kibotos.core.units import parse_duration

F = TypeVar("F", bound=Callable[..., Any])

_DIR = click.option(
    "--dir", "directory", required=True, type=click.Path(file_okay=False, path_type=Path),
    help="Directory that holds the cluster's configs, state, logs and PID files.")
_JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def _errors(func: F) -> F:
    """Print a `KibotosError` the way every kibotos command does and exit with its code."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except KibotosError as exc:
            Output(bool(kwargs.get("as_json"))).error(exc)
            sys.exit(exc.exit_code)

    return wrapper  # type: ignore[return-value]


def _duration(_ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return parse_duration(value, f"--{param.name}")
    except KibotosError as exc:
        raise click.BadParameter(exc.message) from None


@click.group("dev")
def dev_group() -> None:
    """Development tools: a local cluster for trying kibotos and for tests."""


@dev_group.group("cluster")
def cluster_group() -> None:
    """ctrl and N nodes as processes on this machine, all under one directory."""


@cluster_group.command("up")
@_DIR
@click.option("--nodes", type=AsciiInt(1, 64), default=3, show_default=True,
              help="How many nodes to start (node-1 … node-N).")
@click.option("--shared-pool", is_flag=True,
              help="Also attach every node to one pool `shared` at DIR/shared-pool.")
@click.option("--cpu", default="4", show_default=True,
              help="CPU cores each node gives to VMs (decimal allowed).")
@click.option("--memory", default="8G", show_default=True,
              help="Memory each node gives to VMs, e.g. 8G or 512M.")
@click.option("--timeout", default="60s", show_default=True, callback=_duration,
              help="How long to wait for ctrl and every node to be READY.")
@click.option("--reconcile-interval", default=None, callback=_duration,
              help="ctrl's reconciliation interval (default 60s; tests use a few seconds).")
@click.option("--session-timeout", default=None, callback=_duration,
              help="How long ctrl waits for a silent node before it declares the "
                   "session dead (default 15s).")
@click.option("--test-inputs", is_flag=True,
              help="Give every node the test inputs of docs/dev.md: a clock skew file and a "
                   "prepared proc tree under DIR/nodes/<id>/.")
@click.option("--gateways/--no-gateways", default=True, show_default=True,
              help="Also start the E2B and Exposure gateways (docs/gateways.md) on "
                   "loopback, create an API key and write DIR/e2b.env for the E2B SDKs.")
@click.option("--store", type=click.Choice(["sqlite", "postgresql"]), default="sqlite",
              show_default=True,
              help="ctrl's store: a SQLite file, or a PostgreSQL server started under "
                   "DIR/postgres (Debian's postgresql package).")
@click.option("--ctrl-replicas", type=AsciiInt(1, 5), default=1, show_default=True,
              help="How many ctrl replicas to run (more than one needs --store "
                   "postgresql; docs/replicas.md).")
@_errors
def up_command(directory: Path, nodes: int, shared_pool: bool, cpu: str, memory: str,
               timeout: float, reconcile_interval: float | None,
               session_timeout: float | None, test_inputs: bool, gateways: bool,
               store: str, ctrl_replicas: int) -> None:
    """Start ctrl and the nodes, enroll an operator into DIR/kibo.toml, and wait until
    every node is READY.  Prints the line that points `kibo` at the cluster."""
    from kibotos.dev import DevCluster

    out = Output(False)
    cluster = DevCluster(directory, timeout=timeout)
    cluster.up(
        nodes,
        shared_pool=shared_pool,
        cpu=cpu,
        memory=memory,
        reconcile_interval=None if reconcile_interval is None else f"{reconcile_interval}s",
        session_timeout=None if session_timeout is None else f"{session_timeout}s",
        test_inputs=test_inputs,
        store=store,
        ctrl_replicas=ctrl_replicas,
        log=out.message,
    )
    if gateways:
        try:
            urls = cluster.start_e2b_gateway()
        except BaseException:
            cluster.down(grace=5.0)
            raise
        out.message(f"E2B gateway: API {urls.api_url}, sandboxes {urls.sandbox_url}; "
                    f"Exposure gateway: {urls.exposure_url} (Host: <port>-<sandbox>."
                    f"{urls.domain}); for the E2B SDKs: set -a; . "
                    f"{shlex.quote(str(urls.env_file))}; set +a")
    config = shlex.quote(str(cluster.layout.kibo_config))
    out.message(f"{nodes} node(s) READY; ctrl at {cluster.ctrl_url}. Use the cluster with:")
    out.line(f"export KIBO_CONFIG={config}")
    out.message(f"Stop it with: kibotos dev cluster down --dir {shlex.quote(str(cluster.dir))}")


@cluster_group.command("down")
@_DIR
@click.option("--grace", default="10s", show_default=True, callback=_duration,
              help="How long to wait after SIGTERM before SIGKILL.")
@_errors
def down_command(directory: Path, grace: float) -> None:
    """Stop every process the cluster in DIR started; its files stay."""
    from kibotos.dev import DevCluster

    out = Output(False)
    cluster = DevCluster(directory)
    if not cluster.layout.exists():
        from kibotos.core.errors import NotFound

        raise NotFound(f"{cluster.dir} holds no dev cluster")
    stopped = cluster.down(grace=grace)
    out.message(f"stopped {', '.join(stopped)}" if stopped else "nothing was running")


@cluster_group.command("status")
@_DIR
@_JSON
@_errors
def status_command(directory: Path, as_json: bool) -> None:
    """Each process of the cluster: PID, whether it runs, and the node status in ctrl."""
    from kibotos.dev import DevCluster

    out = Output(as_json)
    rows = DevCluster(directory).status()
    if as_json:
        out.json_result({"processes": [r.to_json() for r in rows]})
        return
    out.table(
        ["PROCESS", "PID", "RUNNING", "STATUS"],
        [[r.name, "-" if r.pid is None else str(r.pid), "yes" if r.pid else "no",
          "-" if r.node_status is None else r.node_status] for r in rows],
    )
