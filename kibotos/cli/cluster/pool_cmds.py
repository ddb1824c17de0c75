"""``kibo storage-pool``: see pools, their members and objects; set a pool's capacity;
declare a pool lost (docs/storage.md, "Storage pools in ctrl").

Every argument is checked before the config is read or anything is sent, so bad input
(exit code 10 for a bad value, 2 for a bad combination of flags) changes nothing.  A
capacity that was never set shows as ``-``: creating in that pool is refused with
``resource_exhausted`` until ``set-capacity`` is run.
"""

from __future__ import annotations

from typing import Any

import click

from kibotos.cli.core.client import resource_path
from kibotos.cli.core.options import (
    Invocation,
    check_command_id,
    kibo_options,
    versioned_write_options,
)
from kibotos.cli.core.output import Section, confirm_or_abort, dash, yes_no
from kibotos.core import ids
from kibotos.core.errors import InvalidArgument
from kibotos.core.units import format_bytes, parse_size

LIST_COLUMNS = ("POOL", "MODE", "CAPACITY", "RESERVED", "FREE", "MEMBERS", "AVAILABLE",
                "STATE")
OBJECT_COLUMNS = ("KIND", "OBJECT", "CAPACITY", "WORKSPACE", "WS_STATE", "HOLDER", "EPOCH")


@click.group("storage-pool")
def pool_group() -> None:
    """See storage pools and the objects in them; set capacity; declare a pool lost."""


def pool_path(pool_id: str, action: str = "") -> str:
    return resource_path("/v1/storage-pools", pool_id, action)


def size(value: Any) -> str:
    """Bytes for people; ``-`` when not set (a pool without capacity)."""
    return format_bytes(value) if isinstance(value, int) else "-"


def _state(pool: dict[str, Any]) -> str:
    if pool.get("lost"):
        return "LOST"
    if pool.get("capacity_bytes") is None:
        return "NO_CAPACITY"
    return "OK"


def list_row(pool: dict[str, Any]) -> list[str]:
    members = pool.get("members") or []
    return [dash(pool.get("pool_id")), dash(pool.get("mode")), size(pool.get("capacity_bytes")),
            size(pool.get("reserved_bytes")), size(pool.get("free_bytes")),
            str(len(members)), str(pool.get("available_members", 0)), _state(pool)]


def get_sections(pool: dict[str, Any]) -> list[Section]:
    s = Section(f"Storage pool {dash(pool.get('pool_id'))}")
    s.add("Mode", dash(pool.get("mode")))
    s.add_fields(pool, {"Capacity": "capacity_bytes", "Reserved": "reserved_bytes",
                        "Free": "free_bytes"}, size)
    s.add("Marker instance", dash(pool.get("instance")))
    s.add("Registered node", dash(pool.get("registered_node_id")))
    s.add("Lost", yes_no(pool.get("lost")) if not pool.get("lost") else
          f"yes, since {pool.get('lost_at')} (instance {dash(pool.get('lost_instance'))})")
    s.add("Revision", dash(pool.get("revision")))
    members = Section("Nodes")
    for m in pool.get("members") or []:
        flags = ", ".join(x for x in (dash(m.get("node_status")), dash(m.get("driver")),
                                      "default" if m.get("default") else "") if x)
        verdict = "available" if m.get("available") else \
            f"unavailable: {dash(m.get('reason'))}"
        members.add(dash(m.get("node_id")), f"{verdict} ({flags})")
    if not members.lines:
        members.add("Members", "- (no node that is not retired or revoked declares it)")
    out = [s, members]
    refused = pool.get("refused") or []
    if refused:
        r = Section("Refused storages")
        for item in refused:
            r.add(dash(item.get("node_id")),
                  f"instance {dash(item.get('instance'))}: {dash(item.get('reason'))}")
        out.append(r)
    return out


def _pool_id(value: str) -> str:
    return ids.check_pool_id(value)


# ---------------------------------------------------------------------------- reads


@pool_group.command("list")
@kibo_options
def list_pools(inv: Invocation) -> None:
    """List storage pools: capacity, reservations, members, state."""
    inv.list_table("/v1/storage-pools", "pools", LIST_COLUMNS, list_row)


@pool_group.command("get")
@click.argument("pool_id", metavar="POOL")
@kibo_options
def get_pool(inv: Invocation, pool_id: str) -> None:
    """Show one pool: capacity, reservations, each node's availability with reason."""
    _pool_id(pool_id)
    pool = inv.client().get(pool_path(pool_id))
    inv.out.result(pool, lambda: inv.out.sections(get_sections(pool)))


@pool_group.command("objects")
@click.argument("pool_id", metavar="POOL")
@kibo_options
def pool_objects(inv: Invocation, pool_id: str) -> None:
    """List the retained layers and Volumes in a pool, with holder node and epoch."""
    _pool_id(pool_id)
    inv.list_table(pool_path(pool_id, "objects"), "objects", OBJECT_COLUMNS, _object_row)


def _object_row(o: dict[str, Any]) -> list[str]:
    return [dash(o.get("kind")), dash(o.get("object_id")), size(o.get("capacity_bytes")),
            dash(o.get("workspace_id")), dash(o.get("workspace_state")),
            dash(o.get("holder_node_id")), dash(o.get("epoch"))]


# ---------------------------------------------------------------------------- writes


@pool_group.command("set-capacity")
@click.argument("pool_id", metavar="POOL")
@click.argument("capacity", metavar="SIZE")
@versioned_write_options
def set_capacity(inv: Invocation, pool_id: str, capacity: str, command_id: str | None,
                 expected_version: int | None) -> None:
    """Set a pool's capacity (e.g. 500G, 2T); never below what is reserved in it."""
    _pool_id(pool_id)
    capacity_bytes = parse_size(capacity, "SIZE")
    if capacity_bytes <= 0:
        raise InvalidArgument(f"SIZE must be more than 0, got {capacity!r}")
    check_command_id(command_id)
    pool = inv.client().post(pool_path(pool_id, "set-capacity"), {
        "capacity_bytes": capacity_bytes, "command_id": command_id,
        "expected_version": expected_version})
    if inv.as_json:
        inv.out.json_result(pool)
    else:
        inv.out.line(f"storage pool {pool_id}: capacity {size(pool.get('capacity_bytes'))}, "
                     f"{size(pool.get('reserved_bytes'))} reserved, revision "
                     f"{pool.get('revision')}")


@pool_group.command("declare-lost")
@click.argument("pool_id", metavar="POOL")
@click.option("--confirm-data-lost", is_flag=True,
              help="Required: you assert the pool's storage is gone for good.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (needed without a "
                                          "terminal).")
@versioned_write_options
def declare_lost(inv: Invocation, pool_id: str, confirm_data_lost: bool, yes: bool,
                 command_id: str | None, expected_version: int | None) -> None:
    """Declare a pool without members lost: its Workspaces can then only be deleted."""
    if not confirm_data_lost:
        raise click.UsageError(
            "--confirm-data-lost is required: declare-lost asserts that the pool's storage "
            "is gone for good; its Workspaces become FAILED and can only be deleted")
    _pool_id(pool_id)
    check_command_id(command_id)
    confirm_or_abort(yes, "declare-lost", f"Declare storage pool {pool_id} lost? Its "
                     "Workspaces can only be deleted afterwards")
    result = inv.client().post(pool_path(pool_id, "declare-lost"), {
        "confirm_data_lost": True, "command_id": command_id,
        "expected_version": expected_version})
    if inv.as_json:
        inv.out.json_result(result)
        return
    failed = result.get("failed_workspaces") or []
    inv.out.line(f"storage pool {pool_id} declared lost: {len(failed)} workspace(s) moved "
                 f"to FAILED, {result.get('forgotten_objects', 0)} object(s) of deletes "
                 "forgotten")
