"""``kibo workspace``: create, start, stop, delete, set-network, get, list, move and
cleanup-status (docs/workspaces.md, docs/network.md; spec/nodes.txt, "Which node runs
a Workspace" and "Placing a Workspace on a specific node").

`create`, `start` and `stop` wait by default until the Workspace is settled (AVAILABLE,
STOPPED, FAILED or DELETED): the global ``--timeout`` bounds the wait (exit 16, the
request stays accepted), a Workspace that ends FAILED is exit 13.  ``--no-wait``
returns as soon as ctrl accepted the request.  Every argument is checked before the
config is read or anything is sent.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import click

from kibotos.cli.cluster import network_cmds as network
from kibotos.cli.core import waiting
from kibotos.cli.core.lazy_group import LazyGroup
from kibotos.cli.core.numbers import AsciiInt
from kibotos.cli.core.options import (
    Invocation,
    check_command_id,
    command_id_option,
    kibo_options,
    node_id_argument,
    parse_labels,
    versioned_write_options,
)
from kibotos.cli.core.paging import read_pages, say_more
from kibotos.cli.workspace import volume_cmds
from kibotos.cli.workspace import workspace_render as render
from kibotos.core import ids
from kibotos.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KibotosError,
    NotFound,
)
from kibotos.core.units import format_bytes, parse_decimal, parse_size

SETTLED = frozenset({"AVAILABLE", "STOPPED", "FAILED", "DELETED"})


# exec, cp and port-forward need the data plane's clients: imported only when one of
# them runs.
@click.group("workspace", cls=LazyGroup, lazy={
    "exec": "kibotos.cli.workspace.exec_cmds:exec_command",
    "cp": "kibotos.cli.workspace.cp_cmds:cp_command",
    "port-forward": "kibotos.cli.workspace.port_forward_cmds:port_forward_command"})
def workspace_group() -> None:
    """Create, start, stop, delete, find and move Workspaces."""


def ws_path(workspace_id: str, action: str = "") -> str:
    path = f"/v1/workspaces/{quote(workspace_id, safe='')}"
    return f"{path}/{action}" if action else path


def workspace_argument(value: str) -> str:
    return ids.check_object_id(value, "workspace ID")


def parse_cpu(value: str | None) -> int | None:
    """Cores as a decimal (``0.5``) → millicores."""
    if value is None:
        return None
    cores = parse_decimal(value, "--cpu")
    millis = cores * 1000
    if millis != millis.to_integral_value() or not 0 < millis <= 1_000_000:
        raise InvalidArgument(f"invalid --cpu {value!r}: a number of cores above 0, at most "
                              "1000, with at most three decimal places")
    return int(millis)


def _size(value: str | None, what: str) -> int | None:
    return None if value is None else parse_size(value, what)


# ------------------------------------------------------------------------ waiting


def wait_settled(inv: Invocation, ws: dict[str, Any], verb: str) -> dict[str, Any]:
    """Follow the Workspace until it is settled.  A restarting or slow ctrl is waited
    out; only the global --timeout ends the wait (16, the request stays accepted)."""
    client = inv.client()
    path = ws_path(str(ws.get("workspace_id")))

    def read(hold: float) -> dict[str, Any]:
        if hold < 1.0:
            # ctrl cannot hold the request (a short request timeout, or little time
            # left): poll, but not in a busy loop.
            waiting.pause(inv, 0.5)
        result: dict[str, Any] = client.get(path, {"wait_s": round(hold, 3)})
        return result

    return waiting.wait_until(
        inv, ws, done=lambda r: r.get("state") in SETTLED,
        waiting=lambda r: f"waiting for workspace {ws.get('workspace_id')} ({r.get('state')})",
        read=read, timed_out=lambda r: _still(inv, r, verb))


def _still(inv: Invocation, ws: dict[str, Any], verb: str) -> DeadlineExceeded:
    workspace_id = ws.get("workspace_id")
    return DeadlineExceeded(
        f"workspace {workspace_id} is still {ws.get('state')} after the global --timeout "
        f"of {inv.deadline.seconds:g}s; the {verb} was accepted and goes on (follow it "
        f"with `kibo workspace get {workspace_id}`)",
        details={"workspace_id": workspace_id, "state": ws.get("state")})


def expect(ws: dict[str, Any], wanted: str, verb: str) -> dict[str, Any]:
    if ws.get("state") == wanted:
        return ws
    raise FailedPrecondition(
        f"workspace {ws.get('workspace_id')} is {ws.get('state')} after the {verb}"
        + (f": {ws['reason']}" if ws.get("reason") else ""),
        details={"workspace_id": ws.get("workspace_id"), "state": ws.get("state"),
                 "reason": ws.get("reason")})


def finish(inv: Invocation, ws: dict[str, Any], *, wait: bool, wanted: str,
           verb: str) -> None:
    if wait:
        ws = expect(wait_settled(inv, ws, verb), wanted, verb)
    if inv.as_json:
        inv.out.json_result(ws)
    else:
        line = render.summary(ws)
        inst = ws.get("instance") or {}
        if wanted == "STOPPED" and wait and inst.get("confirmed_on_disk") is not None:
            line += f"; confirmed on disk: {'yes' if inst['confirmed_on_disk'] else 'no'}"
        inv.out.line(line)


def no_wait_option(fn: Any) -> Any:
    return click.option("--no-wait", is_flag=True,
                        help="Return once ctrl accepted it, without waiting for a settled "
                             "state.")(fn)


# ------------------------------------------------------------------------ writes


@workspace_group.command("create")
@click.option("--template", required=True, metavar="NAME", help="The Template to start from.")
@click.option("--label", "label_items", multiple=True, metavar="KEY=VALUE",
              help="A label (repeatable).")
@click.option("--node", "node_id", metavar="NODE",
              help="Place it on this node only; fails rather than going elsewhere.")
@click.option("--cpu", metavar="CORES", help="CPU cores (decimal), default 1.")
@click.option("--memory", metavar="SIZE", help="Memory, e.g. 2G (default 1G).")
@click.option("--layer-size", metavar="SIZE", help="Writable layer capacity (default 10G).")
@click.option("--volume", "volume_items", multiple=True, metavar="VOL[:MOUNTPOINT]",
              help="Attach a Volume, mounted at MOUNTPOINT in the guest (default "
                   "/mnt/VOL; repeatable).")
@network.policy_options
@no_wait_option
@command_id_option
@kibo_options
def create(inv: Invocation, template: str, label_items: tuple[str, ...], node_id: str | None,
           cpu: str | None, memory: str | None, layer_size: str | None,
           volume_items: tuple[str, ...], allow_out: tuple[str, ...],
           deny_out: tuple[str, ...], no_public_egress: bool, egress: str | None,
           resolver: str | None, no_wait: bool, command_id: str | None) -> None:
    """Create a Workspace and, by default, wait until it is AVAILABLE.

    Without a network flag it gets the deployment default (the network its node
    provides); any network flag gives it an explicit policy, placed only on a node
    that can enforce it."""
    flags = (allow_out, deny_out, no_public_egress, egress, resolver)
    policy = network.policy_from_flags(*flags) if network.any_policy_flag(*flags) else None
    body = {"template": template, "labels": parse_labels(label_items), "network": policy,
            "volumes": volume_cmds.parse_attachments(volume_items) or None,
            "node_id": None if node_id is None else node_id_argument(node_id),
            "cpu_millis": parse_cpu(cpu), "memory_bytes": _size(memory, "--memory"),
            "layer_size_bytes": _size(layer_size, "--layer-size"),
            "command_id": check_command_id(command_id)}
    ws = inv.client().post("/v1/workspaces", body)
    finish(inv, ws, wait=not no_wait, wanted="AVAILABLE", verb="create")


@workspace_group.command("start")
@click.argument("workspace_id", metavar="WORKSPACE")
@click.option("--node", "node_id", metavar="NODE", help="Start it on this node only.")
@no_wait_option
@versioned_write_options
def start(inv: Invocation, workspace_id: str, node_id: str | None, no_wait: bool,
          command_id: str | None, expected_version: int | None) -> None:
    """Start a STOPPED or FAILED Workspace as a new Instance."""
    workspace_argument(workspace_id)
    ws = inv.client().post(ws_path(workspace_id, "start"), {
        "node_id": None if node_id is None else node_id_argument(node_id),
        "command_id": check_command_id(command_id), "expected_version": expected_version})
    finish(inv, ws, wait=not no_wait, wanted="AVAILABLE", verb="start")


@workspace_group.command("stop")
@click.argument("workspace_id", metavar="WORKSPACE")
@click.option("--force", is_flag=True,
              help="Destroy the Instance after a short guest sync (not confirmed on disk).")
@no_wait_option
@versioned_write_options
def stop(inv: Invocation, workspace_id: str, force: bool, no_wait: bool,
         command_id: str | None, expected_version: int | None) -> None:
    """Stop a Workspace; by default wait until it is STOPPED."""
    workspace_argument(workspace_id)
    ws = inv.client().post(ws_path(workspace_id, "stop"), {
        "force": force or None, "command_id": check_command_id(command_id),
        "expected_version": expected_version})
    finish(inv, ws, wait=not no_wait, wanted="STOPPED", verb="stop")


@workspace_group.command("delete")
@click.argument("workspace_id", metavar="WORKSPACE")
@click.option("--wait", is_flag=True, help="Wait until it is DELETED.")
@versioned_write_options
def delete(inv: Invocation, workspace_id: str, wait: bool, command_id: str | None,
           expected_version: int | None) -> None:
    """Delete a STOPPED or FAILED Workspace with its writable layer."""
    workspace_argument(workspace_id)
    ws = inv.client().post(ws_path(workspace_id, "delete"), {
        "command_id": check_command_id(command_id), "expected_version": expected_version})
    finish(inv, ws, wait=wait, wanted="DELETED", verb="delete")


@workspace_group.command("set-network")
@click.argument("workspace_id", metavar="WORKSPACE")
@network.policy_options
@click.option("--default", "use_default", is_flag=True,
              help="Back to the deployment default (the network the node provides).")
@versioned_write_options
def set_network(inv: Invocation, workspace_id: str, allow_out: tuple[str, ...],
                deny_out: tuple[str, ...], no_public_egress: bool, egress: str | None,
                resolver: str | None, use_default: bool, command_id: str | None,
                expected_version: int | None) -> None:
    """Replace the Workspace's WHOLE network policy with the one these flags give.

    Flags left out take their defaults (public egress on, no --allow-out or
    --deny-out, no Egress, no Resolver): what the policy had before is not kept.  A
    running Workspace's node applies it at once, without a restart (established
    connections are kept); a stopped one's next start uses it."""
    workspace_argument(workspace_id)
    flags = (allow_out, deny_out, no_public_egress, egress, resolver)
    if use_default and network.any_policy_flag(*flags):
        raise click.UsageError("--default excludes the other network flags")
    ws = inv.client().post(ws_path(workspace_id, "set-network"), {
        "network": None if use_default else network.policy_from_flags(*flags),
        "command_id": check_command_id(command_id), "expected_version": expected_version})
    if inv.as_json:
        inv.out.json_result(ws)
        return
    net = ws.get("network") or {}
    inv.out.line(f"{render.summary(ws)}; network policy revision {net.get('revision')}: "
                 f"{network.describe_policy(net.get('policy'))}")


# ------------------------------------------------------------------------ reads


def location_of(inv: Invocation, workspace_id: str) -> dict[str, Any] | None:
    """The location query; None when ctrl has none (an older ctrl)."""
    try:
        found: dict[str, Any] = inv.client().get(ws_path(workspace_id, "location"))
        return found
    except NotFound as exc:
        if "no such API route" in exc.message:
            return None
        raise


@workspace_group.command("get")
@click.argument("workspace_id", metavar="WORKSPACE")
@click.option("--wide", is_flag=True, help="Add the Instance line and the last Instance.")
@kibo_options
def get(inv: Invocation, workspace_id: str, wide: bool) -> None:
    """Show one Workspace and the node it runs on."""
    workspace_argument(workspace_id)
    ws = inv.client().get(ws_path(workspace_id))
    if inv.as_json:
        inv.out.json_result(ws)
        return
    inv.out.sections(render.get_sections(ws, location_of(inv, workspace_id), wide=wide))


@workspace_group.command("list")
@click.option("--node", "node_id", metavar="NODE", help="Workspaces executing on this node.")
@click.option("--instance", "instance_id", metavar="INSTANCE",
              help="The Workspace executing as this Instance.")
@click.option("--state", "states", multiple=True, metavar="STATE",
              help="Only these states (repeatable); DELETED ones only when asked.")
@click.option("--label", "label_items", multiple=True, metavar="KEY=VALUE",
              help="Only Workspaces with this label (repeatable).")
@click.option("--all", "all_pages", is_flag=True, help="Follow every page.")
@click.option("-q", "--quiet", is_flag=True, help="Print only Workspace IDs, one per line.")
@click.option("--wide", is_flag=True, help="Add the INSTANCE and NODE columns.")
@click.option("--page-size", type=AsciiInt(1, 500), default=100, show_default=True)
@click.option("--page-token", metavar="TOKEN", help="Continue from a previous page.")
@kibo_options
def list_workspaces(inv: Invocation, node_id: str | None, instance_id: str | None,
                    states: tuple[str, ...], label_items: tuple[str, ...], all_pages: bool,
                    quiet: bool, wide: bool, page_size: int, page_token: str | None) -> None:
    """List Workspaces, or those executing on a node or as an Instance."""
    if node_id is not None and instance_id is not None:
        raise click.UsageError("--node and --instance are mutually exclusive")
    located = node_id is not None or instance_id is not None
    if located and (states or label_items):
        raise click.UsageError("--node and --instance cannot be combined with --state or "
                               "--label")
    if node_id is not None:
        node_id_argument(node_id)
    if instance_id is not None:
        ids.check_object_id(instance_id, "instance ID")
    labels = parse_labels(label_items)
    client = inv.client()

    def located_page(token: str | None) -> dict[str, Any]:
        """A page of locations, as the page of the Workspaces found there."""
        page = client.get("/v1/workspace-locations", {
            "node_id": node_id, "instance_id": instance_id, "page_size": page_size,
            "page_token": token})
        found = []
        for loc in page.get("locations") or []:
            try:
                found.append(client.get(ws_path(str(loc["workspace_id"]))))
            except NotFound:
                continue  # deleted between the two reads
        return {"workspaces": found, "next_page_token": page.get("next_page_token")}

    def filtered_page(token: str | None) -> dict[str, Any]:
        page: dict[str, Any] = client.get("/v1/workspaces", {
            "state": ",".join(s.upper() for s in states) or None,
            "label": ",".join(f"{k}={v}" for k, v in labels.items()) or None,
            "page_size": page_size, "page_token": token})
        return page

    workspaces, token = read_pages(located_page if located else filtered_page,
                                   "workspaces", page_token, all_pages)
    if inv.as_json:
        inv.out.json_result({"workspaces": workspaces, "next_page_token": token})
    elif quiet:
        for ws in workspaces:
            inv.out.line(str(ws.get("workspace_id")))
    else:
        inv.out.table(render.WIDE_COLUMNS if wide else render.LIST_COLUMNS,
                      [render.list_row(ws, wide=wide) for ws in workspaces])
    say_more(inv.out, token, "workspaces")


@workspace_group.command("cleanup-status")
@click.argument("workspace_id", metavar="WORKSPACE")
@kibo_options
def cleanup_status(inv: Invocation, workspace_id: str) -> None:
    """What the Workspace's last Instance still holds on its node, and who says so;
    for a release stuck on the node, since when and which parts it still holds."""
    workspace_argument(workspace_id)
    status = inv.client().get(ws_path(workspace_id, "cleanup-status"))
    if inv.as_json:
        inv.out.json_result(status)
        return
    inv.out.line(f"workspace {workspace_id}: Instance {status.get('instance_id') or '-'} "
                 f"on node {status.get('node_id') or '-'}")
    inv.out.table(render.CLEANUP_COLUMNS, render.cleanup_rows(status))
    for line in render.cleanup_pending_lines(status):
        inv.out.line(line)


# ------------------------------------------------------------------------ move


@workspace_group.command("move")
@click.argument("workspace_id", metavar="WORKSPACE")
@click.option("--node", "node_id", required=True, metavar="NODE", help="The target node.")
@no_wait_option
@command_id_option
@kibo_options
def move(inv: Invocation, workspace_id: str, node_id: str, no_wait: bool,
         command_id: str | None) -> None:
    """Stop a Workspace and start it on another node (no live migration)."""
    workspace_argument(workspace_id)
    node_id_argument(node_id)
    base = check_command_id(command_id) or ids.new_id("kibo")
    if len(base) > 122:
        raise InvalidArgument("--command-id of a move may have at most 122 characters "
                              "(the stop and start add /stop and /start)")
    client = inv.client()
    # 1. Check: the objects' pools against what the target node reports available.
    check = client.get(ws_path(workspace_id, "move-check"), {"node_id": node_id})
    ws = check["workspace"]
    if ws.get("state") not in SETTLED:
        ws = wait_settled(inv, ws, "move")  # a stop or start already under way
        check = client.get(ws_path(workspace_id, "move-check"), {"node_id": node_id})
        ws = check["workspace"]
    if check.get("already_there") and ws.get("state") == "AVAILABLE":  # not FAILED there
        _moved(inv, ws, f"workspace {workspace_id} already runs on node {node_id}")
        return
    # 2. Stop, if it runs.
    if ws.get("state") == "AVAILABLE":
        stopping = client.post(ws_path(workspace_id, "stop"), {"command_id": f"{base}/stop"})
        ws = expect(wait_settled(inv, stopping, "stop"), "STOPPED", "stop")
    elif ws.get("state") == "DELETED":
        raise FailedPrecondition(f"workspace {workspace_id} is DELETED")
    # 3. Start on the target node.
    try:
        ws = client.post(ws_path(workspace_id, "start"),
                         {"node_id": node_id, "command_id": f"{base}/start"})
        if not no_wait:
            ws = expect(wait_settled(inv, ws, "start"), "AVAILABLE", "start")
    except KibotosError as exc:
        raise type(exc)(
            f"{exc.message}; workspace {workspace_id} is no longer running: start it again "
            f"with `kibo workspace start {workspace_id} --node {node_id}`",
            details={**exc.details, "workspace_id": workspace_id,
                     "retry": f"kibo workspace start {workspace_id} --node {node_id}"}
        ) from None
    _moved(inv, ws, f"moved workspace {workspace_id} to node {node_id}: {render.summary(ws)}")


def _moved(inv: Invocation, ws: dict[str, Any], line: str) -> None:
    inv.out.result(ws, lambda: inv.out.line(line))


# ------------------------------------------------------------------------ writable layer


def _layer_done(inv: Invocation, workspace_id: str, status: dict[str, Any], verb: str,
                wait: bool) -> None:
    what = f"the writable layer of workspace {workspace_id}"
    if wait:
        status = volume_cmds.check_outcome(volume_cmds.follow(
            inv, status, ws_path(workspace_id, "layer"), what, verb, settled=None,
            holds=False), what, verb)
    if inv.as_json:
        inv.out.json_result(status)
        return
    size = status.get("size_bytes")
    line = (f"workspace {workspace_id}: writable layer "
            f"{format_bytes(size) if isinstance(size, int) else '-'} in pool "
            f"{status.get('pool_id')}")
    if status.get("operation"):
        line += f"; {volume_cmds.operation_text(status['operation'])}"
    inv.out.line(line)


@workspace_group.command("expand-layer")
@click.argument("workspace_id", metavar="WORKSPACE")
@volume_cmds.new_size_option
@no_wait_option
@versioned_write_options
def expand_layer(inv: Invocation, workspace_id: str, size: str, no_wait: bool,
                 command_id: str | None, expected_version: int | None) -> None:
    """Expand a stopped Workspace's writable layer (e2fsck and resize2fs on the node)."""
    workspace_argument(workspace_id)
    status = inv.client().post(ws_path(workspace_id, "expand-layer"),
                               volume_cmds.expand_body(size, command_id, expected_version))
    _layer_done(inv, workspace_id, status, "expansion", not no_wait)


@workspace_group.command("move-layer")
@click.argument("workspace_id", metavar="WORKSPACE")
@volume_cmds.target_pool_option
@no_wait_option
@versioned_write_options
def move_layer(inv: Invocation, workspace_id: str, pool_id: str, no_wait: bool,
               command_id: str | None, expected_version: int | None) -> None:
    """Copy a stopped Workspace's writable layer into another pool."""
    workspace_argument(workspace_id)
    status = inv.client().post(ws_path(workspace_id, "move-layer"),
                               volume_cmds.move_body(pool_id, command_id, expected_version))
    _layer_done(inv, workspace_id, status, "move", not no_wait)

