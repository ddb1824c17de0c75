"""``kibotos plugins list``: which backends this host would load, and from where.

It runs the very discovery the roles run (`kibotos.plugins.load_plugins`), with the
block list of the role's config file when one is given, so what it shows is what
``kibotos ctrl serve`` or ``kibotos node serve`` with that file would get; a broken or
duplicate plugin fails here with the same message and exit code.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import click

from kibotos import config as config_mod
from kibotos.cli.core.output import Output
from kibotos.core.errors import KibotosError
from kibotos.plugins import BlockedPlugin, PluginInfo, load_plugins


def _disable_list(path: Path) -> list[str]:
    """``[plugins] disable`` of a ctrl.toml or node.toml (told apart by its ``[node]``)."""
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        data = {}  # config_mod.load reports the problem with its usual message
    model: type[config_mod.NodeConfig] | type[config_mod.CtrlConfig] = (
        config_mod.NodeConfig if "node" in data else config_mod.CtrlConfig
    )
    return list(config_mod.load(model, path).plugins.disable)


def _plugin_json(info: PluginInfo) -> dict[str, str]:
    # Every field, by its name: what `kibotos plugins list --json` shows is the record.
    return dataclasses.asdict(info)


def _blocked_json(item: BlockedPlugin) -> dict[str, str | None]:
    return {"plugin": item.plugin, "source": item.source, "module": item.module}


@click.group("plugins")
def plugins_group() -> None:
    """The plugins of this host: VMM backends, storage drivers, placement, supervisors."""


@plugins_group.command("list")
@click.option("--json", "as_json", is_flag=True, help='Print {"result": ...} as JSON.')
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="PATH",
    help="ctrl.toml or node.toml whose [plugins] disable list applies.",
)
def list_command(as_json: bool, config_path: Path | None) -> None:
    """List every backend by kind and name, the plugin that registered it, its version
    and source (builtin, entry-point, test), then the blocked plugins."""
    out = Output(as_json)
    try:
        disable = _disable_list(config_path) if config_path is not None else []
        regs = load_plugins(disable)
    except KibotosError as exc:
        out.error(exc)
        raise click.exceptions.Exit(exc.exit_code) from None
    infos = sorted(regs.infos, key=lambda i: (i.kind, i.name))
    if as_json:
        out.json_result(
            {
                "plugins": [_plugin_json(i) for i in infos],
                "blocked": [_blocked_json(b) for b in regs.blocked],
            }
        )
        return
    out.table(
        ["KIND", "NAME", "PLUGIN", "VERSION", "SOURCE"],
        [[i.kind.replace("_", "-"), i.name, i.plugin, i.version, i.source] for i in infos],
    )
    if regs.blocked:
        out.table(
            ["BLOCKED", "SOURCE", "MODULE"],
            [[b.plugin, b.source, b.module or "-"] for b in regs.blocked],
        )
