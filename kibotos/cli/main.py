"""The three console scripts: ``kibotos`` (roles), ``kibo`` (operator CLI) and
``kibotos-node`` (the node role's group).

Groups are imported lazily (`kibotos.cli.core.lazy_group`) so ``kibo --help`` stays instant;
each group lives in its own module and exposes one click group object named in
`_KIBO_GROUPS` or `_KIBOTOS_GROUPS`.  A command imports only
what it uses (issue 14: each ``kibo`` command within 0.25 s; bench/cli.py measures it),
so nothing heavy (pydantic, httpx, rich, trio, cryptography) may be imported at the top
of a ``kibo`` command module: tests/cli/test_cli_imports.py checks it.
"""

from __future__ import annotations

import click

from kibotos._version import __version__
from kibotos.cli.core.lazy_group import LazyGroup

# command name -> "module:attribute" of a click command or group
_KIBOTOS_GROUPS = {
    "ctrl": "kibotos.cli.roles.ctrl_cmds:ctrl_group",
    "node": "kibotos.cli.roles.node_role_cmds:node_role_group",
    "dev": "kibotos.cli.roles.dev_cmds:dev_group",
    "dataplane": "kibotos.cli.roles.dataplane_cmds:dataplane_group",
    "egress": "kibotos.cli.roles.egress_cmds:egress_group",
    "plugins": "kibotos.cli.roles.plugins_cmds:plugins_group",
    "gateway": "kibotos.cli.roles.gateway_cmds:gateway_group",
}
_KIBO_GROUPS = {
    "enroll": "kibotos.cli.cluster.enrollment_cmds:enroll_command",
    "enrollment": "kibotos.cli.cluster.enrollment_cmds:enrollment_group",
    "node": "kibotos.cli.cluster.node_cmds:node_group",
    "storage-pool": "kibotos.cli.cluster.pool_cmds:pool_group",
    "template": "kibotos.cli.workspace.template_cmds:template_group",
    "workspace": "kibotos.cli.workspace.workspace_cmds:workspace_group",
    "volume": "kibotos.cli.workspace.volume_cmds:volume_group",
    "transfer": "kibotos.cli.workspace.transfer_cmds:transfer_group",
    "egress": "kibotos.cli.cluster.network_cmds:egress_group",
    "resolver": "kibotos.cli.cluster.network_cmds:resolver_group",
    "api-key": "kibotos.cli.cluster.api_key_cmds:api_key_group",
}


@click.group(cls=LazyGroup, lazy=_KIBOTOS_GROUPS)
@click.version_option(__version__, prog_name="kibotos")
def kibotos_cli() -> None:
    """kibotos: Workspaces in microVMs across a cluster of nodes."""


@click.group(cls=LazyGroup, lazy=_KIBO_GROUPS)
@click.version_option(__version__, prog_name="kibo")
def kibo_cli() -> None:
    """kibo: the operator CLI of a kibotos cluster."""


@kibo_cli.command("completion")
@click.argument("shell", type=click.Choice(["bash", "zsh"]))
def completion_command(shell: str) -> None:
    """Print the shell completion script for SHELL (click's shell completion).

    \b
    eval "$(kibo completion bash)"      # in ~/.bashrc
    eval "$(kibo completion zsh)"       # in ~/.zshrc
    """
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    assert cls is not None  # both choices are click's built-in shells
    click.echo(cls(kibo_cli, {}, "kibo", COMPLETE_VAR).source())


#: The environment variable click's completion scripts set when they call ``kibo``.
COMPLETE_VAR = "_KIBO_COMPLETE"


def kibotos_main() -> None:
    kibotos_cli.main(prog_name="kibotos")


def kibo_main() -> None:
    kibo_cli.main(prog_name="kibo", complete_var=COMPLETE_VAR)


def kibotos_node_main() -> None:
    group = kibotos_cli.get_command(click.Context(kibotos_cli), "node")
    assert group is not None
    group.main(prog_name="kibotos-node")


if __name__ == "__main__":  # pragma: no cover
    kibotos_main()
