"""``kibo node``: view nodes and change their registration (spec/nodes.txt, "kibo node").

Every argument is checked before the config is read or anything is sent, so bad input
(exit code 10 for a bad value, 2 for a bad combination of flags) changes nothing.
"""

from __future__ import annotations

import time
from typing import Any

import click

from kibotos.cli.cluster import node_render
from kibotos.cli.cluster.overcommit_cmds import overcommit_group
from kibotos.cli.core.client import resource_path
from kibotos.cli.core.numbers import AsciiFloat, AsciiInt
from kibotos.cli.core.options import (
    Invocation,
    check_command_id,
    kibo_options,
    node_id_argument,
    versioned_write_options,
)
from kibotos.cli.core.output import confirm_or_abort
from kibotos.cli.core.paging import read_pages, say_more
from kibotos.core.errors import DeadlineExceeded, FailedPrecondition, Unavailable

#: How often `drain --wait` asks ctrl for the node (a fixed interval, per the spec).
DRAIN_POLL_INTERVAL = 2.0


@click.group("node")
def node_group() -> None:
    """View nodes, drain, isolate and retire them, and set overcommit ratios."""


def node_path(node_id: str, action: str = "") -> str:
    return resource_path("/v1/nodes", node_id, action)


# ---------------------------------------------------------------------------- reads


@node_group.command("list")
@click.option("--page-size", type=AsciiInt(1, 500), default=100, show_default=True,
              help="Nodes per page (ctrl sorts and pages).")
@click.option("--page-token", metavar="TOKEN", help="Continue from a previous page.")
@click.option("--all", "all_pages", is_flag=True, help="Follow every page.")
@click.option("--wide", is_flag=True, help="Add the REG_VERSION column.")
@kibo_options
def list_nodes(inv: Invocation, page_size: int, page_token: str | None, all_pages: bool,
               wide: bool) -> None:
    """List nodes, one row each."""
    client = inv.client()
    nodes, token = read_pages(
        lambda token: client.get("/v1/nodes", {"page_size": page_size, "page_token": token,
                                               "order_by": "node_id"}),
        "nodes", page_token, all_pages)
    columns = node_render.WIDE_COLUMNS if wide else node_render.LIST_COLUMNS
    inv.out.result({"nodes": nodes, "next_page_token": token}, lambda: inv.out.table(
        columns, [node_render.list_row(n, wide=wide) for n in nodes]))
    say_more(inv.out, token, "nodes")


@node_group.command("get")
@click.argument("node_id", metavar="NODE")
@click.option("--wide", is_flag=True,
              help="Add the registration version, incarnation, session ID and the "
                   "reported version.")
@kibo_options
def get_node(inv: Invocation, node_id: str, wide: bool) -> None:
    """Show one node's registration record and latest host usage."""
    node_id_argument(node_id)
    node = inv.client().get(node_path(node_id))
    inv.out.result(node, lambda: inv.out.sections(node_render.get_sections(node, wide=wide)))


# ---------------------------------------------------------------------------- drain


def _summary(node: dict[str, Any]) -> str:
    return (f"node {node.get('node_id')}: status {node.get('status')}, "
            f"registration version {node.get('registration_version')}")


def _counts(node: dict[str, Any]) -> str:
    report = node.get("latest_report") or {}
    return (f"{report.get('instance_count', '-')} instance(s), "
            f"{report.get('volume_count', '-')} volume(s)")


def _wait_drained(inv: Invocation, node: dict[str, Any], interval: float) -> dict[str, Any]:
    """Poll until DRAINED; a cancelled drain or a revoked or retired node ends it (13),
    the global --timeout too (16), and the drain stays requested either way.  While
    ctrl cannot be reached (e.g. it restarts) the wait goes on."""
    node_id = str(node.get("node_id"))
    client = inv.client()
    announced = unreachable = False
    while True:
        status = node.get("status")
        if status == "DRAINED":
            return node
        if status == "RETIRED" or node.get("retired"):
            raise FailedPrecondition(f"node {node_id} was retired while waiting for it "
                                     "to drain")
        if status == "REVOKED" or node.get("admission") == "revoked":
            raise FailedPrecondition(f"node {node_id} was revoked while waiting for it "
                                     "to drain")
        if not node.get("drain_requested"):
            raise FailedPrecondition(f"the drain of node {node_id} was cancelled while "
                                     "waiting for it")
        if not announced:
            inv.out.message(f"waiting for node {node_id} to drain ({_counts(node)})")
            announced = True
        remaining = inv.deadline.remaining()
        if remaining is not None and remaining <= 0:
            raise _still_draining(inv, node, str(status))
        time.sleep(interval if remaining is None else min(interval, remaining))
        try:
            node = client.get(node_path(node_id))
            unreachable = False
        except (Unavailable, DeadlineExceeded) as exc:
            # A restarting or slow ctrl is no reason to give up a long wait; only the
            # global --timeout ends it.
            if inv.deadline.expired():
                raise _still_draining(inv, node, str(status)) from None
            if not unreachable:
                inv.out.message(f"{exc.message}; still waiting")
            unreachable = True


def _still_draining(inv: Invocation, node: dict[str, Any], status: str) -> DeadlineExceeded:
    node_id = str(node.get("node_id"))
    return DeadlineExceeded(
        f"node {node_id} did not reach DRAINED within the global --timeout of "
        f"{inv.deadline.seconds:g}s (status {status}, {_counts(node)}); the drain stays "
        "requested and kibo does not submit it again",
        details={"node_id": node_id, "status": status})


@node_group.command("drain")
@click.argument("node_id", metavar="NODE")
@click.option("--wait", is_flag=True,
              help="Wait until the node is DRAINED (bounded by the global --timeout).")
@click.option("--poll-interval", type=AsciiFloat(min=0.01), default=DRAIN_POLL_INTERVAL,
              hidden=True)
@versioned_write_options
def drain(inv: Invocation, node_id: str, wait: bool, poll_interval: float,
          command_id: str | None, expected_version: int | None) -> None:
    """Stop placing new Workspaces on a node; existing ones keep running."""
    node_id_argument(node_id)
    check_command_id(command_id)
    node = inv.client().post(node_path(node_id, "drain"),
                             {"command_id": command_id, "expected_version": expected_version})
    if wait:
        node = _wait_drained(inv, node, poll_interval)
    inv.out.result(node, lambda: inv.out.line(f"drain requested for {_summary(node)}"))


@node_group.command("cancel-drain")
@click.argument("node_id", metavar="NODE")
@versioned_write_options
def cancel_drain(inv: Invocation, node_id: str, command_id: str | None,
                 expected_version: int | None) -> None:
    """Let placement use the node again."""
    node_id_argument(node_id)
    check_command_id(command_id)
    node = inv.client().post(node_path(node_id, "cancel-drain"),
                             {"command_id": command_id, "expected_version": expected_version})
    inv.out.result(node, lambda: inv.out.line(f"drain cancelled for {_summary(node)}"))


# ------------------------------------------------------------------ isolate, retire


def _count(value: Any) -> int:
    if isinstance(value, list):
        return len(value)
    return int(value) if isinstance(value, int) else 0


@node_group.command("isolate")
@click.argument("node_id", metavar="NODE")
@click.option("--confirm-host-cannot-write", is_flag=True,
              help="Required: you assert the host is powered off or can no longer write "
                   "to any of its storage pools.")
@versioned_write_options
def isolate(inv: Invocation, node_id: str, confirm_host_cannot_write: bool,
            command_id: str | None, expected_version: int | None) -> None:
    """Declare a down node's host cut off from its storage, releasing what it held."""
    if not confirm_host_cannot_write:
        raise click.UsageError(
            "--confirm-host-cannot-write is required: isolate asserts that the host is "
            "powered off or can no longer write to any of its storage pools, and a wrong "
            "assertion corrupts the block files it is using")
    node_id_argument(node_id)
    check_command_id(command_id)
    result = inv.client().post(node_path(node_id, "isolate"), {
        "confirm_host_cannot_write": True,
        "command_id": command_id,
        "expected_version": expected_version,
    })
    if inv.as_json:
        inv.out.json_result(result)
        return
    inv.out.line(
        f"isolated node {node_id}: released {_count(result.get('released_volumes'))} "
        f"volume(s) and {_count(result.get('released_retained_layers'))} retained "
        f"layer(s); {_count(result.get('failed_workspaces'))} workspace(s) moved to FAILED")


@node_group.command("retire")
@click.argument("node_id", metavar="NODE")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (needed without a "
                                          "terminal).")
@versioned_write_options
def retire(inv: Invocation, node_id: str, yes: bool, command_id: str | None,
           expected_version: int | None) -> None:
    """Retire a node whose host will not come back. This is final."""
    if command_id is not None and expected_version is None:
        raise click.UsageError("--command-id needs --expected-version too, so a replay "
                               "does not depend on the version read at run time")
    node_id_argument(node_id)
    check_command_id(command_id)
    confirm_or_abort(yes, "retire", f"Retire node {node_id}? Retirement is final: the "
                     "node ID can never register again")
    node = inv.client().post(node_path(node_id, "retire"),
                             {"command_id": command_id, "expected_version": expected_version})
    inv.out.result(node, lambda: inv.out.line(f"retired {_summary(node)}"))


node_group.add_command(overcommit_group)
