"""``kibo api-key create|list|revoke``: the API keys the gateways' callers present
(docs/gateways.md).

``create`` prints the key on stdout (it is shown this once; ctrl keeps only its hash)
and what it is on stderr, so ``KEY=$(kibo api-key create ci)`` captures the key alone.
Names and teams are checked here with ctrl's rule before anything is sent.
"""

from __future__ import annotations

from typing import Any

import click

from kibotos.cli.core.client import resource_path
from kibotos.cli.core.options import Invocation, check_command_id, command_id_option, kibo_options
from kibotos.cli.core.output import dash
from kibotos.core import ids

COLUMNS = ("KEY", "NAME", "TEAM", "STATE", "CREATED", "REVOKED")


@click.group("api-key")
def api_key_group() -> None:
    """API keys of the E2B gateway, each belonging to a team."""


def _row(key: dict[str, Any]) -> list[str]:
    return [dash(key.get(f)) for f in ("key_id", "name", "team", "state", "created_at",
                                       "revoked_at")]


@api_key_group.command("create")
@click.argument("name")
@click.option("--team", default="default", show_default=True, metavar="TEAM",
              help="The team the key belongs to: it sees only this team's sandboxes.")
@command_id_option
@kibo_options
def create(inv: Invocation, name: str, team: str, command_id: str | None) -> None:
    """Create an API key; prints the key (a secret, shown once)."""
    body = {"name": ids.check_resource_name(name, "key name"),
            "team": ids.check_resource_name(team, "--team"),
            "command_id": check_command_id(command_id)}
    result = inv.client().post("/v1/api-keys", body)

    def for_people() -> None:
        inv.out.line(str(result.get("key")))
        inv.out.message(f"API key {result.get('key_id')} ({result.get('name')}) of team "
                        f"{result.get('team')}: store it now, it is not shown again")

    inv.out.result(result, for_people)


@api_key_group.command("list")
@kibo_options
def list_keys(inv: Invocation) -> None:
    """List API keys (never their secrets)."""
    inv.list_table("/v1/api-keys", "api_keys", COLUMNS, _row)


@api_key_group.command("revoke")
@click.argument("key_id", metavar="KEY_ID")
@command_id_option
@kibo_options
def revoke(inv: Invocation, key_id: str, command_id: str | None) -> None:
    """Revoke an API key: the gateways refuse it from then on."""
    ids.check_object_id(key_id, "API key ID")
    result = inv.client().post(resource_path("/v1/api-keys", key_id, "revoke"),
                               {"command_id": check_command_id(command_id)})
    inv.out.result(result, lambda: inv.out.line(
        f"API key {result.get('key_id')} revoked at {dash(result.get('revoked_at'))}"))
