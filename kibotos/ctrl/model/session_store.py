"""What a control session writes to the store, one transaction per event.

The hello decision lives here, in one transaction with the node row locked, so it is
taken against the same state isolate and retire change.  Every later write names the
session it comes from and is dropped if the node has since started another session: a
late message from a replaced connection must not overwrite the new one's facts.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from kibotos.ctrl.model import nodes, overcommit
from kibotos.ctrl.pools import facts as pool_facts
from kibotos.ctrl.store.models import Identity, Node
from kibotos.ctrl.wire.base import parse_time
from kibotos.protocol import Hello, RejectReason, ReportFields


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: RejectReason | None = None
    message: str | None = None
    overcommit: dict[str, Any] | None = None
    cleared_isolate: bool = False
    drain_requested: bool = False


#: The most an incarnation may grow between two sessions ctrl sees (a node adds one per
#: start; the first session counts from 0).  A node that sends more is broken or
#: hostile: accepted, its number would become the floor for good, and an incarnation
#: near the ceiling would leave no number its restarts could use.
MAX_INCARNATION_JUMP = 1_000_000


def _reject(reason: RejectReason, message: str) -> Verdict:
    return Verdict(False, reason, message)


def _apply_report(node: Node, report: ReportFields, now: datetime) -> None:
    node.report_at = now
    node.allocated_cpu_millis = report.allocated.cpu_millis
    node.allocated_memory_bytes = report.allocated.memory_bytes
    node.instance_count = report.instance_count
    node.volume_count = report.volume_count
    node.memory_tight = report.memory_tight
    node.memory_tight_since = (parse_time(report.memory_tight_since, "memory_tight_since")
                               if report.memory_tight else None)


def evaluate_hello(session: Session, identity_id: str, hello: Hello, session_id: str,
                   now: datetime, replica_id: str | None = None) -> Verdict:
    """Accept or reject a node's hello.  Order matters: an isolated incarnation is told
    so first (the node must destroy its Instances even if it was also retired or
    revoked since), then retirement, revocation, and stale incarnations.  `replica_id`
    names the ctrl replica that holds the session (None: a lone ctrl on SQLite)."""
    identity = session.get(Identity, identity_id)
    if identity is None or identity.node_id != hello.node_id:
        owner = identity.node_id if identity is not None else None
        return _reject(RejectReason.NOT_ADMITTED,
                       f"this identity belongs to node {owner}, not {hello.node_id}")
    node = session.get(Node, hello.node_id, with_for_update=True)
    if node is None:
        return _reject(RejectReason.NOT_ADMITTED, f"node {hello.node_id} is not registered")
    inc = hello.incarnation
    if node.isolated_incarnation is not None and inc <= node.isolated_incarnation:
        nodes.record_event(session, now, node.node_id, "session.rejected",
                           {"reason": "isolated", "incarnation": inc})
        return _reject(
            RejectReason.ISOLATED,
            f"incarnation {inc} of node {node.node_id} was isolated (isolated incarnation "
            f"{node.isolated_incarnation}): destroy every Instance and restart")
    if node.retired_at is not None:
        return _reject(RejectReason.NOT_ADMITTED, f"node {node.node_id} is retired")
    if identity.revoked_at is not None or node.admission != "admitted":
        return _reject(RejectReason.NOT_ADMITTED,
                       f"the identity of node {node.node_id} was revoked")
    if node.incarnation is not None and inc < node.incarnation:
        return _reject(
            RejectReason.STALE_INCARNATION,
            f"incarnation {inc} is older than the latest seen ({node.incarnation})")
    if inc > (node.incarnation or 0) + MAX_INCARNATION_JUMP:
        return _reject(
            RejectReason.INVALID_HELLO,
            f"incarnation {inc} is implausible: more than {MAX_INCARNATION_JUMP} above the "
            f"latest seen ({node.incarnation or 0})")
    cleared = False
    if node.isolated_incarnation is not None:
        nodes.record_event(session, now, node.node_id, "node.isolate_cleared",
                           {"isolated_incarnation": node.isolated_incarnation,
                            "incarnation": inc})
        node.isolated_incarnation = None
        cleared = True
    node.incarnation = inc
    node.session_id = session_id
    node.session_alive = True
    node.session_replica = replica_id
    node.session_started_at = now
    node.session_ended_at = None
    node.release_version = hello.release_version
    node.source_revision = hello.source_revision
    node.resources_cpu_millis = hello.resources.cpu_millis
    node.resources_memory_bytes = hello.resources.memory_bytes
    node.dataplane_address = hello.dataplane_address
    pool_facts.store_facts(session, node, hello.facts, now, replace=True)
    node.host_usage = None
    node.host_usage_at = None
    _apply_report(node, hello.report, now)
    # The welcome carries the current ratios: delivering it is the confirmation.
    node.overcommit_confirmed_serial = node.overcommit_sent_serial
    nodes.bump(node)
    return Verdict(True, overcommit=overcommit.push_message(node, overcommit.get_default(session)),
                   cleared_isolate=cleared, drain_requested=node.drain_requested)


def _current(session: Session, node_id: str, session_id: str) -> Node | None:
    node = session.get(Node, node_id, with_for_update=True)
    if node is None or node.session_id != session_id or not node.session_alive:
        return None
    return node


def end_session(session: Session, node_id: str, session_id: str, now: datetime) -> None:
    node = _current(session, node_id, session_id)
    if node is None:
        return
    node.session_alive = False
    node.session_ended_at = now
    nodes.bump(node)


def store_report(session: Session, node_id: str, session_id: str, report: ReportFields,
                 now: datetime) -> bool:
    node = _current(session, node_id, session_id)
    if node is None:
        return False
    _apply_report(node, report, now)
    if report.facts is not None:  # pool availability changes while a session lives
        pool_facts.store_facts(session, node, report.facts, now, replace=False)
    nodes.bump(node)
    return True


def store_clock(session: Session, node_id: str, session_id: str, offset_ms: float,
                uncertainty_ms: float, sync_status: str, now: datetime) -> None:
    node = _current(session, node_id, session_id)
    if node is None:
        return
    node.clock_offset_ms = offset_ms
    node.clock_uncertainty_ms = uncertainty_ms
    node.clock_sync_status = sync_status
    node.clock_measured_at = now


def store_usage(session: Session, node_id: str, session_id: str,
                sample: dict[str, Any] | None, now: datetime) -> None:
    node = _current(session, node_id, session_id)
    if node is None:
        return
    node.host_usage = sample
    node.host_usage_at = now


def overcommit_to_push(session: Session, node_id: str,
                       session_id: str) -> dict[str, Any] | None:
    """The ratios to send, or None if there is nothing unconfirmed."""
    node = session.get(Node, node_id)
    if node is None or node.session_id != session_id or nodes.overcommit_confirmed(node):
        return None
    return overcommit.push_message(node, overcommit.get_default(session))


def confirm_overcommit(session: Session, node_id: str, session_id: str, serial: int) -> None:
    node = _current(session, node_id, session_id)
    if node is None:
        return
    node.overcommit_confirmed_serial = max(node.overcommit_confirmed_serial,
                                           min(serial, node.overcommit_sent_serial))


def still_admitted(session: Session, identity_id: str, node_id: str) -> bool:
    identity = session.get(Identity, identity_id)
    node = session.get(Node, node_id)
    return (identity is not None and identity.revoked_at is None and node is not None
            and node.retired_at is None and node.admission == "admitted")


def mark_all_dead(session: Session, now: datetime) -> int:
    """At ctrl start: sessions held by the previous process died with it."""
    result = session.execute(
        update(Node)
        .where(Node.session_alive.is_(True))
        .values(session_alive=False, session_ended_at=now,
                registration_version=Node.registration_version + 1)
    )
    return int(getattr(result, "rowcount", 0) or 0)
