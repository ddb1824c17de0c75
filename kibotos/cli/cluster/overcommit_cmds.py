"""``kibo node overcommit``: the ratios that turn reported resources into schedulable ones.

Ratios are checked here with `kibotos.core.units.parse_ratio` (0–16, at most three decimal
places) and sent in canonical form (``"2.50"`` goes as ``"2.5"``), so bad input never
reaches ctrl and a replay of the same command ID sees the same input however it was
spelled.  A command changes only the items given; ctrl keeps the other.  With an
explicit ``--command-id`` the caller must pass ``--expected-version`` and both ratios,
so the replayed input does not depend on values read at run time (spec/nodes.txt).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import click

from kibotos.cli.core.options import (
    Invocation,
    check_command_id,
    kibo_options,
    node_id_argument,
    versioned_write_options,
)
from kibotos.cli.core.output import Section, dash
from kibotos.core.units import format_ratio, parse_ratio


@click.group("overcommit")
def overcommit_group() -> None:
    """View and set CPU and memory overcommit ratios."""


def _ratio(value: str | None, what: str, *, allow_default: bool) -> str | None:
    if value is None:
        return None
    if allow_default and value.strip() == "default":
        return "default"
    return format_ratio(parse_ratio(value, what))


def _check_replayable(command_id: str | None, expected_version: int | None,
                      cpu: str | None, memory: str | None) -> None:
    if command_id is None:
        return
    missing = [flag for flag, value in (("--expected-version", expected_version),
                                        ("--cpu", cpu), ("--memory", memory))
               if value is None]
    if missing:
        raise click.UsageError(
            f"--command-id needs {', '.join(missing)} too: with an explicit command ID, "
            "pass --expected-version and both ratios so a replay does not depend on "
            "values read at run time")


def _show_default(inv: Invocation, result: dict[str, Any]) -> None:
    default = result.get("default") or {}
    section = Section("Cluster-wide default")
    section.add("CPU", dash(default.get("cpu")))
    section.add("Memory", dash(default.get("memory")))
    section.add("Version", dash(result.get("version")))
    inv.out.sections([section])


@overcommit_group.command("get")
@kibo_options
def get_overcommit(inv: Invocation) -> None:
    """Show the cluster-wide default ratios and every node's overrides."""
    result = inv.client().get("/v1/overcommit")
    inv.out.result(result, lambda: _show_overcommit(inv, result))


def _show_overcommit(inv: Invocation, result: dict[str, Any]) -> None:
    _show_default(inv, result)
    overrides = result.get("overrides") or []
    if overrides:
        inv.out.line("")
        rows = [[dash(o.get("node_id")), o.get("cpu") or "default",
                 o.get("memory") or "default", dash(o.get("registration_version"))]
                for o in overrides]
        inv.out.table(("NODE", "CPU", "MEMORY", "REG_VERSION"), rows, title="Overrides")
    else:
        inv.out.line("")
        inv.out.line("No node overrides.")


@overcommit_group.command("set-default")
@click.option("--cpu", metavar="RATIO", help="CPU ratio, 0-16, at most 3 decimals.")
@click.option("--memory", metavar="RATIO", help="Memory ratio, 0-16, at most 3 decimals.")
@versioned_write_options
def set_default(inv: Invocation, cpu: str | None, memory: str | None,
                command_id: str | None, expected_version: int | None) -> None:
    """Change the cluster-wide default; its expected version is `get`'s version."""
    if cpu is None and memory is None:
        raise click.UsageError("give --cpu, --memory or both")
    _check_replayable(command_id, expected_version, cpu, memory)
    body = {
        "cpu": _ratio(cpu, "CPU ratio", allow_default=False),
        "memory": _ratio(memory, "memory ratio", allow_default=False),
        "expected_version": expected_version,
        "command_id": check_command_id(command_id),
    }
    result = inv.client().put("/v1/overcommit/default", body)
    if inv.as_json:
        inv.out.json_result(result)
    else:
        _show_default(inv, result)


@overcommit_group.command("set")
@click.argument("node_id", metavar="NODE")
@click.option("--cpu", metavar="RATIO|default",
              help="CPU ratio for this node, or `default` to clear the override.")
@click.option("--memory", metavar="RATIO|default",
              help="Memory ratio for this node, or `default` to clear the override.")
@versioned_write_options
def set_node(inv: Invocation, node_id: str, cpu: str | None, memory: str | None,
             command_id: str | None, expected_version: int | None) -> None:
    """Override one node's ratios; its expected version is its registration_version."""
    if cpu is None and memory is None:
        raise click.UsageError("give --cpu, --memory or both")
    _check_replayable(command_id, expected_version, cpu, memory)
    node_id_argument(node_id)
    body = {
        "cpu": _ratio(cpu, "CPU ratio", allow_default=True),
        "memory": _ratio(memory, "memory ratio", allow_default=True),
        "expected_version": expected_version,
        "command_id": check_command_id(command_id),
    }
    node = inv.client().put(f"/v1/nodes/{quote(node_id, safe='')}/overcommit", body)
    if inv.as_json:
        inv.out.json_result(node)
        return
    overcommit = node.get("overcommit") or {}
    parts = []
    for key, label in (("cpu", "CPU"), ("memory", "memory")):
        item = overcommit.get(key) or {}
        parts.append(f"{label} {dash(item.get('ratio'))} ({dash(item.get('source'))})")
    confirmed = "" if overcommit.get("confirmed", True) else "; waiting for the node to confirm"
    inv.out.line(f"node {node.get('node_id')}: overcommit {', '.join(parts)}, registration "
                 f"version {node.get('registration_version')}{confirmed}")
