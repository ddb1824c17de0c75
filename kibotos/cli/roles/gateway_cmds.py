"""``kibotos gateway e2b serve --config FILE`` and ``kibotos gateway exposure serve
--config FILE``: the gateway roles (docs/gateways.md).

The configuration is read and checked before anything listens, so a mistake is one
line naming the field and the exit code of its error kind.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import click

from kibotos import config as config_mod
from kibotos.cli.roles.ctrl_cmds import log_to_stderr, serve_options


@click.group("gateway")
def gateway_group() -> None:
    """Gateways: other systems' APIs over this cluster."""


@gateway_group.group("e2b")
def e2b_group() -> None:
    """The E2B gateway: the official E2B SDKs, unchanged, against this cluster."""


def _serve(load: Callable[[str], Any], serve_fn: Callable[[Any], Awaitable[None]],
           config_path: str, log_level: str) -> None:
    """What a gateway's ``serve`` does: read and check its configuration and its
    credential (refused now, with its reason, rather than at the first call), then
    log to stderr and serve until signalled."""
    import trio

    cfg = load(config_path)
    cfg.read_credential()
    log_to_stderr(log_level)
    trio.run(serve_fn, cfg)


@e2b_group.command("serve")
@serve_options("The gateway's TOML configuration (docs/gateways.md).")
def serve(config_path: str, log_level: str) -> None:
    """Serve E2B's control API and envd's API until SIGTERM or SIGINT."""
    from kibotos.gateway.e2b.config import GatewayConfig
    from kibotos.gateway.e2b.serve import serve_e2b_gateway

    _serve(lambda path: config_mod.load(GatewayConfig, path), serve_e2b_gateway,
           config_path, log_level)


@gateway_group.group("exposure")
def exposure_group() -> None:
    """The Exposure gateway: HTTP and WebSockets to ports in sandboxes."""


@exposure_group.command("serve")
@serve_options("The gateway's TOML configuration (docs/gateways.md).")
def exposure_serve(config_path: str, log_level: str) -> None:
    """Proxy <port>-<sandbox>.<domain> to sandbox ports until SIGTERM or SIGINT."""
    from kibotos.gateway.exposure.config import ExposureConfig
    from kibotos.gateway.exposure.serve import serve_exposure_gateway

    _serve(lambda path: config_mod.load(ExposureConfig, path), serve_exposure_gateway,
           config_path, log_level)
