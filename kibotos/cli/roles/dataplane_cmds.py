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

from pathlib import Path

import click

from kibotos.cli.core.numbers import AsciiFloat, AsciiInt
from kibotos.cli.roles.node_processes import config_option, list_or_stop, node_supervisor, serve


@click.group("dataplane")
def dataplane_group() -> None:
    """The data-plane process (started by the node)."""


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
@click.option("--take-over-from", type=AsciiInt(min=1), default=None, metavar="GENERATION",
              help="Take the listening socket and state of this running generation instead "
                   "of binding (the node's handover within a release line).")
@click.option("--plain", is_flag=True,
              help="Serve plain HTTP instead of TLS (refused unless --listen is a "
                   "loopback address).  Default: TLS with the certificate the node sends.")
def serve_command(listen: str, socket_dir: Path, generation: int,
                  drain_timeout: float, take_over_from: int | None, plain: bool) -> None:
    """Serve exec for the node's Instances until SIGTERM."""
    from kibotos.dataplane.process.serve import DataplaneSettings, serve_dataplane

    serve(serve_dataplane, DataplaneSettings(listen=listen, socket_dir=socket_dir.absolute(),
                                             generation=generation,
                                             drain_timeout=drain_timeout,
                                             take_over_from=take_over_from, tls=not plain),
          "data plane")


def _run_for_node(config_path: Path, action: str, timeout: float) -> None:
    from kibotos.node.dataplane.supervisor import DataplaneSupervisor

    cfg, supervisor = node_supervisor(config_path)
    dp = DataplaneSupervisor(node_id=cfg.node.id, listen=cfg.node.dataplane_listen,
                             socket_dir=cfg.node.socket_dir,
                             state_dir=cfg.storage.root / "state", supervisor=supervisor)
    list_or_stop(dp.units, lambda: dp.stop_all(timeout=timeout), action)


@dataplane_group.command("list")
@config_option
def list_command(config_path: Path) -> None:
    """The node's data-plane units, oldest generation first."""
    _run_for_node(config_path, "list", 0.0)


@dataplane_group.command("stop")
@config_option
@click.option("--timeout", default=15.0, type=AsciiFloat(min=0), show_default=True,
              metavar="SECONDS", help="Per process: how long before SIGKILL (it drains "
                                      "its connections for 10 s first).")
def stop_command(config_path: Path, timeout: float) -> None:
    """End every data-plane process of the node (cuts off exec at once)."""
    _run_for_node(config_path, "stop", timeout)
