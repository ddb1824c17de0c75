"""The three console scripts: ``kibotos`` (roles), ``kibo`` (operator CLI) and
``kibotos-node`` (the node role's group).

Groups are imported lazily so ``kibo --help`` stays instant; each group lives in its own
module and exposes one click group object named in `_LAZY`.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from kibotos._version import __version__

# command name -> "module:attribute" of a click command or group
_KIBOTOS_GROUPS = {
    "ctrl": "kibotos.cli.ctrl_cmds:ctrl_group",
    "node": "kibotos.cli.node_role_cmds:node_role_group",
    "dev": "kibotos.cli.dev_cmds:dev_group",
    "dataplane": "kibotos.cli.dataplane_cmds:dataplane_group",
    "egress": "kibotos.cli.egress_cmds:egress_group",
    "plugins": "kibotos.cli.plugins_cmds:plugins_group",
    "gateway": "kibotos.cli.gateway_cmds:gateway_group",
}
_KIBO_GROUPS = {
    "enroll": "kibotos.cli.enrollment_cmds:enroll_command",
    "enrollment": "kibotos.cli.enrollment_cmds:enrollment_group",
    "node": "kibotos.cli.node_cmds:node_group",
    "storage-pool": "kibotos.cli.pool_cmds:pool_group",
    "template": "kibotos.cli.template_cmds:template_group",
    "workspace": "kibotos.cli.workspace_cmds:workspace_group",
    "volume": "kibotos.cli.volume_cmds:volume_group",
    "transfer": "kibotos.cli.transfer_cmds:transfer_group",
    "egress": "kibotos.cli.network_cmds:egress_group",
    "resolver": "kibotos.cli.network_cmds:resolver_group",
    "api-key": "kibotos.cli.api_key_cmds:api_key_group",
}


class LazyGroup(click.Group):
    def __init__(self, *args: Any, lazy: dict[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self._lazy:
            module, _, attr = self._lazy[cmd_name].partition(":")
            cmd = getattr(importlib.import_module(module), attr)
            assert isinstance(cmd, click.Command)
            return cmd
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, lazy=_KIBOTOS_GROUPS)
@click.version_option(__version__, prog_name="kibotos")
def kibotos_cli() -> None:
    """kibotos: Workspaces in microVMs across a cluster of nodes."""


@click.group(cls=LazyGroup, lazy=_KIBO_GROUPS)
@click.version_option(__version__, prog_name="kibo")
def kibo_cli() -> None:
    """kibo: the operator CLI of a kibotos cluster."""


def kibotos_main() -> None:
    kibotos_cli.main(prog_name="kibotos")


def kibo_main() -> None:
    kibo_cli.main(prog_name="kibo")


def kibotos_node_main() -> None:
    group = kibotos_cli.get_command(click.Context(kibotos_cli), "node")
    assert group is not None
    group.main(prog_name="kibotos-node")


if __name__ == "__main__":  # pragma: no cover
    kibotos_main()
