"""check-maintenance's network rows (spec: "Pre-replacement check: check-maintenance"):
every network record and network namespace of this node must belong to an Instance on
record, and no network switch may be half done.

* A network record (``<storage.root>/network/<instance_id>.json``) whose Instance has
  no record here, or one that cannot be read, is a leftover with no owner (or a
  corrupted record): the new binary could not tell what it describes.
* A record with a ``pending_policy`` is a network switch half done: the node wrote
  that it was switching and did not record the end (it was stopped or died in the
  transaction).  Starting the node finishes it (adoption rewrites the table from the
  pending policy).
* A namespace ``kibotos-<scope>-<instance_id>`` under /run/netns (this node's scope)
  whose Instance has no record is a leftover with no owner.

Read-only: records are parsed, /run/netns is listed, nothing is entered or changed.
"""

from __future__ import annotations

from pathlib import Path

from kibotos.config import NodeConfig
from kibotos.core.errors import FailedPrecondition
from kibotos.node.checks.check_report import Report
from kibotos.node.network.names import NETNS_DIR, node_scope, scope_netns_prefix
from kibotos.node.network.records import NetworkRecords


def check_network(config: NodeConfig, root: Path, owned: set[str], report: Report, *,
                  netns_dir: Path = NETNS_DIR) -> int:
    """The rows above; how many lines blocked."""
    blocked = 0
    records = NetworkRecords(root / "network")
    entries = sorted(records.directory.iterdir()) if records.directory.is_dir() else []
    for entry in entries:
        if entry.name.startswith("."):
            continue  # a temporary file of an interrupted write
        instance_id = entry.name.removesuffix(".json")
        if instance_id not in owned or not entry.name.endswith(".json"):
            blocked += 1
            report.blocked(f"network record {entry} belongs to no Instance: a leftover "
                           "with no owner")
            continue
        try:
            record = records.read(instance_id)
        except FailedPrecondition as exc:
            blocked += 1
            report.blocked(f"network record {entry}: corrupted record: {exc.message}")
            continue
        if record is not None and record.pending_policy is not None:
            blocked += 1
            report.blocked(f"instance {instance_id}: a network switch is half done (its "
                           f"network record {entry} has a pending policy, revision "
                           f"{record.pending_revision}); start the node and let it finish")
    prefix = scope_netns_prefix(node_scope(config.node.socket_dir))
    try:
        names = sorted(n for n in (p.name for p in netns_dir.iterdir()) if n.startswith(prefix))
    except FileNotFoundError:
        names = []
    for name in names:
        if name.removeprefix(prefix) not in owned:
            blocked += 1
            report.blocked(f"network namespace {netns_dir / name} belongs to no Instance: a "
                           "leftover with no owner")
    return blocked
