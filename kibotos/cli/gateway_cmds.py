"""``kibotos gateway e2b serve --config FILE``: the E2B gateway role (docs/gateways.md).

The configuration is read and checked before anything listens, so a mistake is one
line naming the field and the exit code of its error kind.
"""

from __future__ import annotations

import click

from kibotos import config as config_mod
from kibotos.cli.ctrl_cmds import log_to_stderr, serve_options


@click.group("gateway")
def gateway_group() -> None:
    """Gateways: other systems' APIs over this cluster."""


@gateway_group.group("e2b")
def e2b_group() -> None:
    """The E2B gateway: the official E2B SDKs, unchanged, against this cluster."""


@e2b_group.command("serve")
@serve_options("The gateway's TOML configuration (docs/gateways.md).")
def serve(config_path: str, log_level: str) -> None:
    """Serve E2B's control API and envd's API until SIGTERM or SIGINT."""
    import trio

    from kibotos.gateway.e2b.config import GatewayConfig
    from kibotos.gateway.e2b.serve import serve_e2b_gateway

    cfg = config_mod.load(GatewayConfig, config_path)
    cfg.read_credential()  # refused now, with its reason, rather than at the first call
    log_to_stderr(log_level)
    trio.run(serve_e2b_gateway, cfg)
