"""Node registration rules: derived status, admission for placement, and the operator's
management operations (drain, cancel-drain, isolate, retire).

Every function here runs inside one store transaction and takes the node row with
``FOR UPDATE`` before it changes it, so two ctrl replicas on PostgreSQL serialise on
the node.  `registration_version` is the node's expected revision: session changes,
resource reports and management operations all go through `bump`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, cast

from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.core.errors import FailedPrecondition, check_expected_version
from kibotos.ctrl.model.page_tokens import decode_token, encode_token
from kibotos.ctrl.store.models import EnrollmentGrant, Event, Node, existing
from kibotos.ctrl.wire.base import as_utc

#: Placement puts nothing new on a node whose clock offset, less its uncertainty, is
#: beyond this (spec: nodes, "list and get").
CLOCK_LIMIT_MS = 30_000.0


class NodeFacts(Protocol):
    """What the derived views read: a `Node`, or a plain row of its table (the list
    path reads rows, which is several times cheaper than loading ORM objects)."""

    node_id: str
    admission: str
    drain_requested: bool
    isolated_incarnation: int | None
    retired_at: datetime | None
    registration_version: int
    incarnation: int | None
    session_id: str | None
    session_alive: bool
    session_started_at: datetime | None
    session_ended_at: datetime | None
    release_version: str | None
    source_revision: str | None
    clock_offset_ms: float | None
    clock_uncertainty_ms: float | None
    clock_sync_status: str | None
    clock_measured_at: datetime | None
    report_at: datetime | None
    resources_cpu_millis: int
    resources_memory_bytes: int
    allocated_cpu_millis: int
    allocated_memory_bytes: int
    instance_count: int
    volume_count: int
    memory_tight: bool
    memory_tight_since: datetime | None
    host_usage: dict[str, Any] | None
    dataplane_address: str | None
    overcommit_cpu: int | None
    overcommit_memory: int | None
    overcommit_sent_serial: int
    overcommit_confirmed_serial: int


@dataclass(frozen=True)
class IsolateCounts:
    """What an isolate released; summed over every registered releaser."""

    released_volumes: int = 0
    released_retained_layers: int = 0
    failed_workspaces: int = 0

    def __add__(self, other: IsolateCounts) -> IsolateCounts:
        return IsolateCounts(
            self.released_volumes + other.released_volumes,
            self.released_retained_layers + other.released_retained_layers,
            self.failed_workspaces + other.failed_workspaces,
        )


#: Called inside the isolate transaction by the parts of ctrl that own objects held by
#: a node (use rights, Allocations, Workspaces, pending commands); each releases what
#: it owns for the node and says how much.  Registered on `CtrlContext`.
IsolateReleaser = Callable[[Session, str, datetime], IsolateCounts]


def new_node(node_id: str, now: datetime) -> Node:
    """A fresh registration record with every default spelled out (the ORM applies
    column defaults only at flush, and callers read the object before that)."""
    return Node(
        node_id=node_id,
        admission="admitted",
        drain_requested=False,
        isolated_incarnation=None,
        retired_at=None,
        registration_version=1,
        created_at=now,
        session_alive=False,
        resources_cpu_millis=0,
        resources_memory_bytes=0,
        allocated_cpu_millis=0,
        allocated_memory_bytes=0,
        instance_count=0,
        volume_count=0,
        memory_tight=False,
        overcommit_sent_serial=0,
        overcommit_confirmed_serial=0,
    )


def bump(node: Node) -> None:
    node.registration_version += 1


def record_event(session: Session, now: datetime, subject: str, kind: str,
                 detail: dict[str, Any] | None, text: str | None = None) -> None:
    session.add(Event(at=now, subject=subject, kind=kind, detail=detail, text=text))


class StatefulRecord(Protocol):
    """A record with a lifecycle state (a `Workspace`, a `Volume`): its state, the
    reason beside it, its expected revision and when it last changed."""

    state: str
    reason: str | None
    revision: int
    updated_at: datetime


def record_transition(session: Session, subject: str, row: StatefulRecord, to: str,
                      cause: str, now: datetime, *, reason: str | None = None) -> None:
    """Move `row` (the record `subject` names) to state `to`, its reason replaced by
    `reason`, a new revision; the ``transition`` event says from where and why.  One
    rule for every record with a lifecycle, so their event histories read alike."""
    record_event(session, now, subject, "transition",
                 {"from": row.state, "to": to, "cause": cause,
                  **({"reason": reason} if reason else {})})
    row.state = to
    row.reason = reason
    row.revision += 1
    row.updated_at = now


def get_node(session: Session, node_id: str, *, for_update: bool = False) -> Node:
    return existing(session, Node, node_id, "node", "node_id", for_update=for_update)


def check_version(node: Node, expected: int | None) -> None:
    check_expected_version("node", "node_id", node.node_id, node.registration_version,
                           expected, "registration_version")


def refuse_retired(node: Node, what: str) -> None:
    if node.retired_at is not None:
        raise FailedPrecondition(
            f"node {node.node_id} is retired: {what} is not possible (retirement is final)",
            details={"node_id": node.node_id, "status": "RETIRED"},
        )


# --------------------------------------------------------------------- derived state


def is_drained(node: NodeFacts) -> bool:
    return node.drain_requested and node.instance_count == 0 and node.volume_count == 0


def status(node: NodeFacts) -> str:
    """RETIRED › REVOKED › ISOLATED › DRAINED/DRAINING › READY › OFFLINE."""
    if node.retired_at is not None:
        return "RETIRED"
    if node.admission != "admitted":
        return "REVOKED"
    if node.isolated_incarnation is not None:
        return "ISOLATED"
    if node.drain_requested:
        return "DRAINED" if is_drained(node) else "DRAINING"
    return "READY" if node.session_alive else "OFFLINE"


def clock_over(node: NodeFacts) -> bool:
    if node.clock_offset_ms is None:
        return False
    return abs(node.clock_offset_ms) - (node.clock_uncertainty_ms or 0.0) > CLOCK_LIMIT_MS


def overcommit_confirmed(node: NodeFacts) -> bool:
    return node.overcommit_confirmed_serial >= node.overcommit_sent_serial


def placeable(node: NodeFacts) -> tuple[bool, str | None]:
    """Admission for placement: may a new Workspace go to this node at all?  (Whether
    it fits is the capacity check's business; ranking is the placement plugin's.)"""
    if node.retired_at is not None:
        return False, "retired"
    if node.admission != "admitted":
        return False, "not admitted (identity revoked)"
    if node.isolated_incarnation is not None:
        return False, "isolated"
    if node.drain_requested:
        return False, "drain requested"
    if not node.session_alive:
        return False, "no live control session"
    if node.clock_measured_at is None or (
        node.session_started_at is not None
        and as_utc(node.clock_measured_at) < as_utc(node.session_started_at)
    ):
        return False, "clock not measured in this session yet"
    if clock_over(node):
        return False, "clock offset beyond 30 s"
    if node.memory_tight:
        return False, "host memory tight"
    if not overcommit_confirmed(node):
        return False, "overcommit change not yet confirmed by the node"
    return True, None


# -------------------------------------------------------------------------- paging


def list_page(session: Session, page_size: int,
              page_token: str | None) -> tuple[Sequence[NodeFacts], str | None]:
    """One page in node_id order (keyset paging: stable under inserts, no OFFSET), as
    plain rows: nothing on the list path changes a node."""
    table = Node.__table__
    query = select(*table.columns).order_by(table.c.node_id).limit(page_size + 1)
    if page_token:
        query = query.where(table.c.node_id > decode_token(page_token))
    rows = [cast(NodeFacts, row) for row in session.execute(query)]
    if len(rows) > page_size:
        rows = rows[:page_size]
        return rows, encode_token(rows[-1].node_id)
    return rows, None


# ------------------------------------------------------------------ management ops


def drain(session: Session, node_id: str, expected: int | None, now: datetime) -> Node:
    return _set_drain(session, node_id, expected, now, True, "drain")


def cancel_drain(session: Session, node_id: str, expected: int | None, now: datetime) -> Node:
    return _set_drain(session, node_id, expected, now, False, "cancel-drain")


def _set_drain(session: Session, node_id: str, expected: int | None, now: datetime,
               requested: bool, verb: str) -> Node:
    """Drain or cancel it (`verb`, as the CLI spells it): the flag, a new registration
    version, and the event ``node.drain`` or ``node.cancel_drain``."""
    node = get_node(session, node_id, for_update=True)
    refuse_retired(node, verb)
    check_version(node, expected)
    node.drain_requested = requested
    bump(node)
    record_event(session, now, node_id, f"node.{verb.replace('-', '_')}", None)
    return node


def isolate(session: Session, node_id: str, expected: int | None, now: datetime, *,
            alive_here: bool,
            releasers: Sequence[IsolateReleaser] = ()) -> tuple[Node, IsolateCounts]:
    """Record the operator's assertion that the host can no longer write, invalidate
    the node's current incarnation and release what it held.  Refused while the node
    has a live control session: then nobody outside ctrl can vouch for the host."""
    node = get_node(session, node_id, for_update=True)
    refuse_retired(node, "isolate")
    check_version(node, expected)
    if node.session_alive or alive_here:
        raise FailedPrecondition(
            f"node {node_id} has a live control session (incarnation {node.incarnation}): "
            "isolate is only for a node that is down or cut off",
            details={"node_id": node_id, "incarnation": node.incarnation},
        )
    node.isolated_incarnation = node.incarnation or 0
    counts = IsolateCounts()
    for release in releasers:
        counts = counts + release(session, node_id, now)
    bump(node)
    record_event(session, now, node_id, "node.isolate",
                 {"incarnation": node.isolated_incarnation,
                  "released_volumes": counts.released_volumes,
                  "released_retained_layers": counts.released_retained_layers,
                  "failed_workspaces": counts.failed_workspaces})
    return node, counts


def retire(session: Session, node_id: str, expected: int | None, now: datetime) -> Node:
    """Final: only from DRAINED or an isolated incarnation.  Pending grants for the
    node ID are revoked and the session is marked ended (the caller closes it)."""
    node = get_node(session, node_id, for_update=True)
    refuse_retired(node, "retire")
    check_version(node, expected)
    if not (is_drained(node) or node.isolated_incarnation is not None):
        raise FailedPrecondition(
            f"node {node_id} is {status(node)}: retire accepts only a DRAINED node "
            "or one whose current incarnation has been isolated",
            details={"node_id": node_id, "status": status(node)},
        )
    node.retired_at = now
    if node.session_alive:
        node.session_alive = False
        node.session_ended_at = now
    grants = revoke_pending_grants(session, node_id, now)
    bump(node)
    record_event(session, now, node_id, "node.retire", {"revoked_grants": grants})
    return node


def revoke_pending_grants(session: Session, node_id: str, now: datetime) -> list[str]:
    rows = session.scalars(
        select(EnrollmentGrant).where(
            EnrollmentGrant.node_id == node_id,
            EnrollmentGrant.used_at.is_(None),
            EnrollmentGrant.revoked_at.is_(None),
        )
    )
    revoked = []
    for grant in rows:
        grant.revoked_at = now
        revoked.append(grant.grant_id)
    return revoked
