"""How a ``Workspace`` record (the API's JSON, as is) reads for people.

The spec's rules (spec/nodes.txt, "Which node runs a Workspace"): the Node line of
``workspace get`` is the node it executes on, ``-`` when it is not executing, and
``unknown`` when ctrl has no location query; ``--wide`` adds the current Instance; the
list table is the same with or without ``--node``/``--instance``, and ``--wide`` adds
the INSTANCE and NODE columns.  Pure functions of the JSON, tested on fixed fixtures.
"""

from __future__ import annotations

from typing import Any

from kibotos.cli.cluster.network_cmds import describe_policy
from kibotos.cli.core.output import Row, Section, dash
from kibotos.core.units import format_bytes, format_cores

LIST_COLUMNS = ("WORKSPACE", "STATE", "TEMPLATE", "CPU", "MEMORY", "LABELS")
WIDE_COLUMNS = (*LIST_COLUMNS, "INSTANCE", "NODE")
CLEANUP_COLUMNS = ("ITEM", "STATUS", "SOURCE", "OBSERVED")

#: The Node line when ctrl cannot say (an older ctrl without location queries).
UNKNOWN = "unknown"


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def labels(ws: dict[str, Any]) -> str:
    items = sorted(_dict(ws.get("labels")).items())
    return ",".join(f"{k}={v}" for k, v in items) or "-"


def cores(ws: dict[str, Any]) -> str:
    millis = _dict(ws.get("resources")).get("cpu_millis")
    return "-" if not isinstance(millis, int) else format_cores(millis)


def memory(ws: dict[str, Any]) -> str:
    size = _dict(ws.get("resources")).get("memory_bytes")
    return "-" if not isinstance(size, int) else format_bytes(size)


def state(ws: dict[str, Any]) -> str:
    reason = ws.get("reason")
    return f"{ws.get('state')} ({reason})" if reason else str(ws.get("state"))


def list_row(ws: dict[str, Any], *, wide: bool = False) -> Row:
    row = [str(ws.get("workspace_id")), state(ws),
           dash(_dict(ws.get("template")).get("name")), cores(ws), memory(ws), labels(ws)]
    if wide:
        row += [dash(ws.get("instance_id")), dash(ws.get("node_id"))]
    return row


def guest_responding(ws: dict[str, Any]) -> bool | None:
    """What the node last said of the current Instance's guest (``guest.responding`` of
    its ``instance_state`` frame): False while an adopted guest does not answer."""
    inst = _dict(ws.get("instance"))
    if not inst or inst.get("instance_id") != ws.get("instance_id"):
        return None
    responding = _dict(inst.get("guest")).get("responding")
    return responding if isinstance(responding, bool) else None


def get_sections(ws: dict[str, Any], location: dict[str, Any] | None, *,
                 wide: bool = False) -> list[Section]:
    """`location` is ``{node_id, instance_id}`` from the location query, or None when
    ctrl has none (the Node line then says ``unknown``)."""
    main = Section(f"Workspace {ws.get('workspace_id')}")
    main.add("State", str(ws.get("state")))
    main.add("Reason", dash(ws.get("reason")))
    inst = _dict(ws.get("instance"))
    if guest_responding(ws) is False:
        # spec: an adopted Instance whose guest does not answer stays AVAILABLE and
        # "the guest is reported as no longer responding" (docs/adoption.md)
        main.add("Guest", "not responding (the node keeps retrying)")
    if location is None:
        main.add("Node", UNKNOWN)
        if wide:
            main.add("Instance", UNKNOWN)
    else:
        main.add("Node", dash(location.get("node_id")))
        if wide:
            main.add("Instance", dash(location.get("instance_id")))
    template = _dict(ws.get("template"))
    main.add("Template", dash(template.get("name")))
    main.add("Labels", labels(ws))
    main.add("CPU", f"{cores(ws)} cores")
    main.add("Memory", memory(ws))
    layer = _dict(ws.get("layer"))
    size = layer.get("size_bytes")
    main.add("Writable layer", f"{format_bytes(size) if isinstance(size, int) else '-'} in "
                               f"pool {dash(layer.get('pool_id'))}")
    # CLEAN, or UNKNOWN after a takeover without a release receipt (docs/storage.md)
    main.add("Layer handoff", dash(layer.get("handoff")))
    main.add_fields(ws, {"Revision": "revision", "Created": "created_at", "Updated": "updated_at"})
    if ws.get("deleted_at"):
        main.add("Deleted", str(ws.get("deleted_at")))
    # The network in a section of its own: its labels are longer, and the main block
    # keeps the alignment scripts and people already read.
    network = Section("Network")
    net = _dict(ws.get("network"))
    network.add("Policy", describe_policy(net.get("policy")) if net else "-")
    network.add("Revision", dash(net.get("revision")))
    current = inst if inst and inst.get("instance_id") == ws.get("instance_id") else {}
    if current:
        applied = current.get("network")
        network.add("In force", "none (started without a network)" if applied is None
                    else describe_policy(applied))
        addresses = current.get("addresses")
        network.add("Guest addresses", ", ".join(addresses) if addresses else "-")
    sections = [main, network]
    if wide and inst:
        last = Section("Last Instance")
        last.add_fields(inst, {"Instance": "instance_id", "Node": "node_id", "State": "state",
                               "Reason": "reason"})
        confirmed = inst.get("confirmed_on_disk")
        last.add("Stop confirmed on disk",
                 "-" if confirmed is None else ("yes" if confirmed else "no"))
        guest = _dict(inst.get("guest"))
        last.add("Guest boot ID", dash(guest.get("boot_id")))
        responding = guest.get("responding")
        last.add("Guest responding", "-" if not isinstance(responding, bool)
                 else ("yes" if responding else "no"))
        last.add("Template image", dash(template.get("image_digest")))
        sections.append(last)
    return sections


def cleanup_rows(status: dict[str, Any]) -> list[Row]:
    return [[str(i.get("item")), str(i.get("status")), str(i.get("source")),
             dash(i.get("observed_at"))]
            for i in status.get("items") or [] if isinstance(i, dict)]


def cleanup_pending_lines(status: dict[str, Any]) -> list[str]:
    """A release stuck on the node: since when, and each part still held."""
    since = status.get("pending_since")
    if not since:
        return []
    lines = [f"release pending since {since}; still held:"]
    lines += [f"  {h.get('item')}: {h.get('part')}"
              for h in status.get("held") or [] if isinstance(h, dict)]
    return lines


def summary(ws: dict[str, Any]) -> str:
    """One line for a write: ``workspace ws-… AVAILABLE on node node-a (revision 3)``."""
    where = f" on node {ws['node_id']}" if ws.get("node_id") else ""
    return (f"workspace {ws.get('workspace_id')} {state(ws)}{where} "
            f"(revision {ws.get('revision')})")
