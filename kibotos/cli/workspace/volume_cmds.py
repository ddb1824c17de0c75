"""``kibo volume``: create, get, list, expand, move and delete Volumes (docs/cli.md,
docs/storage.md "Volumes"), and the waiting the writable-layer commands of ``kibo
workspace`` (``expand-layer``, ``move-layer``) share with them.

Writes wait by default until the Volume is settled and no operation runs on it: the
global ``--timeout`` bounds the wait (exit 16, the request stays accepted and goes on
in ctrl), an expansion or move that failed, or a create the node refused, is exit 13
with the node's reason.  ``--no-wait`` returns once ctrl accepted the request.  Every
argument is checked before the config is read or anything is sent.
"""

from __future__ import annotations

from typing import Any

import click

from kibotos.cli.core import waiting
from kibotos.cli.core.client import resource_path
from kibotos.cli.core.numbers import AsciiInt
from kibotos.cli.core.options import (
    Invocation,
    check_command_id,
    command_id_option,
    kibo_options,
    new_volume_fields,
    new_volume_options,
    versioned_write_options,
)
from kibotos.cli.core.output import Row, Section, dash
from kibotos.cli.core.paging import read_pages, say_more
from kibotos.core import ids
from kibotos.core.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from kibotos.core.units import format_bytes, parse_size
from kibotos.volume_mounts import check_mount_point

SETTLED = frozenset({"AVAILABLE", "FAILED", "DELETED"})
LIST_COLUMNS = ("VOLUME", "STATE", "POOL", "CAPACITY", "WORKSPACE", "MOUNT POINT",
                "OPERATION")
POLL = 1.0


@click.group("volume")
def volume_group() -> None:
    """Create, inspect, expand, move and delete Volumes."""


def volume_path(volume_id: str, action: str = "") -> str:
    return resource_path("/v1/volumes", volume_id, action)


def volume_argument(value: str) -> str:
    return ids.check_object_id(value, "volume ID")


def size_argument(value: str, what: str) -> int:
    return parse_size(value, what)


def parse_attachments(items: tuple[str, ...]) -> list[dict[str, str]]:
    """``VOL[:MOUNTPOINT]`` (``--volume`` of ``kibo workspace create``), checked as
    ctrl checks them."""
    out: list[dict[str, str]] = []
    for item in items:
        volume_id, sep, mount = item.partition(":")
        ids.check_object_id(volume_id, "volume ID")
        entry = {"volume_id": volume_id}
        if sep:
            try:
                entry["mount_point"] = check_mount_point(mount)
            except InvalidArgument as exc:
                raise InvalidArgument(f"--volume {item}: {exc.message}") from None
        if any(e["volume_id"] == volume_id for e in out):
            raise click.UsageError(f"--volume {volume_id} is given twice")
        out.append(entry)
    return out


# ------------------------------------------------------------------------ rendering


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def operation_text(op: Any) -> str:
    op = _dict(op)
    if not op:
        return "-"
    if op.get("op") == "expand":
        size = op.get("target_capacity_bytes")
        what = f"expand to {format_bytes(size) if isinstance(size, int) else '?'}"
    else:
        what = f"move to {op.get('target_pool_id')}"
    text = f"{what} ({op.get('status')})"
    return f"{text}: {op['error']}" if op.get("error") else text


def _size(value: Any) -> str:
    return format_bytes(value) if isinstance(value, int) else "-"


def volume_row(vol: dict[str, Any]) -> Row:
    state = str(vol.get("state"))
    if vol.get("reason"):
        state += f" ({vol['reason']})"
    return [str(vol.get("volume_id")), state, dash(vol.get("pool_id")),
            _size(vol.get("capacity_bytes")), dash(vol.get("workspace_id")),
            dash(vol.get("mount_point")), operation_text(vol.get("operation"))]


def volume_sections(vol: dict[str, Any]) -> list[Section]:
    main = Section(f"Volume {vol.get('volume_id')}")
    main.add("State", str(vol.get("state")))
    main.add("Reason", dash(vol.get("reason")))
    main.add("Pool", dash(vol.get("pool_id")))
    main.add("Capacity", _size(vol.get("capacity_bytes")))
    main.add_fields(vol, {"Workspace": "workspace_id", "Mount point": "mount_point",
                          "Holder": "holder_node_id", "Epoch": "epoch", "Handoff": "handoff"})
    main.add("Operation", operation_text(vol.get("operation")))
    labels = ",".join(f"{k}={v}" for k, v in sorted(_dict(vol.get("labels")).items()))
    main.add("Labels", labels or "-")
    main.add_fields(vol, {"Revision": "revision", "Created": "created_at", "Updated": "updated_at"})
    if vol.get("deleted_at"):
        main.add("Deleted", str(vol.get("deleted_at")))
    return [main]


def summary(vol: dict[str, Any]) -> str:
    op = vol.get("operation")
    tail = f"; {operation_text(op)}" if op else ""
    return (f"volume {vol.get('volume_id')} {vol.get('state')} in pool "
            f"{vol.get('pool_id')}, {_size(vol.get('capacity_bytes'))}"
            f"{tail} (revision {vol.get('revision')})")


# ------------------------------------------------------------------------ waiting


def _busy(record: dict[str, Any]) -> bool:
    op = _dict(record.get("operation"))
    return bool(op) and op.get("status") != "failed"


def follow(inv: Invocation, record: dict[str, Any], path: str, what: str, verb: str, *,
           settled: frozenset[str] | None = SETTLED, holds: bool = True) -> dict[str, Any]:
    """Read `path` until the record's state is in `settled` (if given) and no
    operation runs on it; only the global --timeout ends the wait (exit 16)."""
    client = inv.client()

    def done(r: dict[str, Any]) -> bool:
        return (settled is None or r.get("state") in settled) and not _busy(r)

    def doing(r: dict[str, Any]) -> str:
        state = operation_text(r.get("operation")) if _busy(r) else r.get("state")
        return f"waiting for {what} ({state})"

    def read(hold: float) -> dict[str, Any]:
        if not holds or hold < 1.0:
            waiting.pause(inv, POLL)
            result: dict[str, Any] = client.get(path)
        else:
            result = client.get(path, {"wait_s": round(hold, 3)})
        return result

    def timed_out(r: dict[str, Any]) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"{what} is not done after the global --timeout of "
            f"{inv.deadline.seconds:g}s; the {verb} was accepted and goes on in ctrl",
            details={"state": r.get("state"), "operation": r.get("operation")})

    return waiting.wait_until(inv, record, done=done, waiting=doing, read=read,
                              timed_out=timed_out, keep_read_error=True)


def check_outcome(record: dict[str, Any], what: str, verb: str) -> dict[str, Any]:
    """A create the node refused, or an operation that failed, is exit 13."""
    op = _dict(record.get("operation"))
    if op.get("status") == "failed":
        raise FailedPrecondition(
            f"the {op.get('op')} of {what} did not complete: {op.get('error')}",
            details={"operation": op})
    if record.get("state") == "FAILED":
        raise FailedPrecondition(f"{what} is FAILED after the {verb}: {record.get('reason')}",
                                 details={"state": "FAILED", "reason": record.get("reason")})
    return record


def no_wait_option(fn: Any) -> Any:
    return click.option("--no-wait", is_flag=True,
                        help="Return once ctrl accepted it, without waiting.")(fn)


def new_size_option(fn: Any) -> Any:
    return click.option("--size", required=True, metavar="SIZE",
                        help="The new capacity (never smaller than the current one).")(fn)


def target_pool_option(fn: Any) -> Any:
    return click.option("--pool", "pool_id", required=True, metavar="POOL",
                        help="The target pool.")(fn)


def expand_body(size: str, command_id: str | None, expected_version: int | None
                ) -> dict[str, Any]:
    """The checked request of an expansion (``volume expand``, ``workspace
    expand-layer``)."""
    return {"capacity_bytes": size_argument(size, "--size"),
            "command_id": check_command_id(command_id), "expected_version": expected_version}


def move_body(pool_id: str, command_id: str | None, expected_version: int | None
              ) -> dict[str, Any]:
    """The checked request of a move (``volume move``, ``workspace move-layer``)."""
    return {"pool_id": ids.check_pool_id(pool_id), "command_id": check_command_id(command_id),
            "expected_version": expected_version}


def _finish(inv: Invocation, vol: dict[str, Any], verb: str, wait: bool) -> None:
    what = f"volume {vol.get('volume_id')}"
    if wait:
        vol = check_outcome(follow(inv, vol, volume_path(str(vol.get("volume_id"))), what,
                                   verb), what, verb)
    inv.out.result(vol, lambda: inv.out.line(summary(vol)))


# ------------------------------------------------------------------------ commands


@volume_group.command("create")
@click.option("--size", required=True, metavar="SIZE", help="Capacity, e.g. 10G.")
@new_volume_options
@no_wait_option
@command_id_option
@kibo_options
def create(inv: Invocation, size: str, pool_id: str | None, label_items: tuple[str, ...],
           no_wait: bool, command_id: str | None) -> None:
    """Create a Volume and, by default, wait until it is AVAILABLE."""
    body = {"capacity_bytes": size_argument(size, "--size"),
            **new_volume_fields(pool_id, label_items),
            "command_id": check_command_id(command_id)}
    vol = inv.client().post("/v1/volumes", body)
    _finish(inv, vol, "create", not no_wait)


@volume_group.command("get")
@click.argument("volume_id", metavar="VOLUME")
@kibo_options
def get(inv: Invocation, volume_id: str) -> None:
    """Show one Volume: pool, capacity, Workspace, holder, running operation."""
    vol = inv.client().get(volume_path(volume_argument(volume_id)))
    inv.out.result(vol, lambda: inv.out.sections(volume_sections(vol)))


@volume_group.command("list")
@click.option("--pool", "pool_id", metavar="POOL", help="Only Volumes in this pool.")
@click.option("--workspace", "workspace_id", metavar="WORKSPACE",
              help="Only Volumes attached to this Workspace.")
@click.option("--deleted", is_flag=True, help="Include DELETED Volumes.")
@click.option("--all", "all_pages", is_flag=True, help="Follow every page.")
@click.option("-q", "--quiet", is_flag=True, help="Print only Volume IDs, one per line.")
@click.option("--page-size", type=AsciiInt(1, 500), default=100, show_default=True)
@click.option("--page-token", metavar="TOKEN", help="Continue from a previous page.")
@kibo_options
def list_volumes(inv: Invocation, pool_id: str | None, workspace_id: str | None,
                 deleted: bool, all_pages: bool, quiet: bool, page_size: int,
                 page_token: str | None) -> None:
    """List Volumes in ID order."""
    if pool_id is not None:
        ids.check_pool_id(pool_id)
    if workspace_id is not None:
        ids.check_object_id(workspace_id, "workspace ID")
    client = inv.client()
    volumes, token = read_pages(lambda token: client.get("/v1/volumes", {
        "pool_id": pool_id, "workspace_id": workspace_id,
        "deleted": "true" if deleted else None, "page_size": page_size,
        "page_token": token}), "volumes", page_token, all_pages)
    if inv.as_json:
        inv.out.json_result({"volumes": volumes, "next_page_token": token})
    elif quiet:
        for vol in volumes:
            inv.out.line(str(vol.get("volume_id")))
    else:
        inv.out.table(LIST_COLUMNS, [volume_row(v) for v in volumes])
    say_more(inv.out, token, "volumes")


@volume_group.command("expand")
@click.argument("volume_id", metavar="VOLUME")
@new_size_option
@no_wait_option
@versioned_write_options
def expand(inv: Invocation, volume_id: str, size: str, no_wait: bool,
           command_id: str | None, expected_version: int | None) -> None:
    """Expand a Volume whose Workspace is stopped (e2fsck and resize2fs on the node)."""
    volume_argument(volume_id)
    vol = inv.client().post(volume_path(volume_id, "expand"),
                            expand_body(size, command_id, expected_version))
    _finish(inv, vol, "expansion", not no_wait)


@volume_group.command("move")
@click.argument("volume_id", metavar="VOLUME")
@target_pool_option
@no_wait_option
@versioned_write_options
def move(inv: Invocation, volume_id: str, pool_id: str, no_wait: bool,
         command_id: str | None, expected_version: int | None) -> None:
    """Copy a Volume into another pool through a node attached to both."""
    volume_argument(volume_id)
    vol = inv.client().post(volume_path(volume_id, "move"),
                            move_body(pool_id, command_id, expected_version))
    _finish(inv, vol, "move", not no_wait)


@volume_group.command("delete")
@click.argument("volume_id", metavar="VOLUME")
@click.option("--wait", is_flag=True, help="Wait until it is DELETED.")
@versioned_write_options
def delete(inv: Invocation, volume_id: str, wait: bool, command_id: str | None,
           expected_version: int | None) -> None:
    """Delete a Volume that no Workspace has attached."""
    volume_argument(volume_id)
    vol = inv.client().post(volume_path(volume_id, "delete"), {
        "command_id": check_command_id(command_id), "expected_version": expected_version})
    if wait:
        vol = follow(inv, vol, volume_path(volume_id), f"volume {volume_id}", "delete",
                     settled=frozenset({"DELETED"}))
    if inv.as_json:
        inv.out.json_result(vol)
    else:
        inv.out.line(summary(vol))
