"""Node commands queued in the store for the replica that holds the node's session.

A replica asked to command a node whose session lives on another replica writes the
command here (`enqueue`, with a ``NOTIFY`` naming the holder, delivered at commit), the
holder takes what is queued for it (`take`), sends it over the session and stores the
outcome (`finish`, with a ``NOTIFY`` naming the row), and the sender reads it
(`outcome`) and deletes the row.  The rows are the only state: a notification lost (a
listener reconnecting) costs a poll interval, never the command.  A command whose
holder dies before it is taken stays queued for a replica that is gone: the sender
gives up at its deadline, deletes it, and reports the node unreachable, as for a
session that ended under a local command.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, select, text, update
from sqlalchemy.orm import Session

from kibotos.ctrl.store.models import CtrlReplica, Node, RelayedCommand

#: The channel a holder listens on for new work (payload: its replica ID).
WORK_CHANNEL = "kibotos_relay_work"
#: The channel senders listen on for outcomes (payload: the relay ID).
DONE_CHANNEL = "kibotos_relay_done"


@dataclass(frozen=True)
class Queued:
    relay_id: str
    node_id: str
    kind: str
    args: dict[str, Any]
    timeout_s: float


def notify(session: Session, channel: str, payload: str) -> None:
    """``NOTIFY`` on PostgreSQL, delivered when the transaction commits (usable in a
    flush hook: it goes through the session's connection, not the unit of work)."""
    if session.get_bind().dialect.name == "postgresql":
        session.connection().execute(text("SELECT pg_notify(:channel, :payload)"),
                                     {"channel": channel, "payload": payload})


def session_holder(session: Session, node_id: str) -> str | None:
    """The live replica holding the node's live session, if any."""
    row = session.execute(
        select(Node.session_replica)
        .join(CtrlReplica, CtrlReplica.replica_id == Node.session_replica)
        .where(Node.node_id == node_id, Node.session_alive.is_(True))).first()
    return None if row is None else row[0]


def alive_elsewhere(session: Session, replica_id: str) -> set[str]:
    """The nodes whose live session another live replica holds."""
    return set(session.scalars(
        select(Node.node_id)
        .join(CtrlReplica, CtrlReplica.replica_id == Node.session_replica)
        .where(Node.session_alive.is_(True), Node.session_replica != replica_id)))


def enqueue(session: Session, relay_id: str, node_id: str, replica_id: str, kind: str,
            args: dict[str, Any], timeout_s: float) -> None:
    session.add(RelayedCommand(relay_id=relay_id, node_id=node_id, replica_id=replica_id,
                               kind=kind, args=args, timeout_s=timeout_s, state="queued",
                               result=None, error=None, created_at=datetime.now(UTC)))
    notify(session, WORK_CHANNEL, replica_id)


def take(session: Session, replica_id: str) -> list[Queued]:
    """Claim every command queued for `replica_id` (each is sent once)."""
    rows = list(session.scalars(
        select(RelayedCommand)
        .where(RelayedCommand.replica_id == replica_id, RelayedCommand.state == "queued")
        .order_by(RelayedCommand.created_at)
        .with_for_update(skip_locked=True)))
    for row in rows:
        row.state = "taken"
    return [Queued(r.relay_id, r.node_id, r.kind, dict(r.args), r.timeout_s) for r in rows]


def finish(session: Session, relay_id: str, result: dict[str, Any] | None,
           error: dict[str, Any] | None) -> None:
    session.execute(update(RelayedCommand).where(RelayedCommand.relay_id == relay_id)
                    .values(state="done", result=result, error=error))
    notify(session, DONE_CHANNEL, relay_id)


def outcome(session: Session, relay_id: str) -> RelayedCommand | None:
    """The row once it is done (deleted then: the sender read it), else None."""
    row = session.get(RelayedCommand, relay_id, with_for_update=True)
    if row is None or row.state != "done":
        return None
    session.delete(row)
    session.flush()
    session.expunge(row)
    return row


def abandon(session: Session, relay_id: str) -> bool:
    """The sender gives up; True if the command had not been taken yet (so it was
    never sent), False if the holder may have sent it."""
    row = session.get(RelayedCommand, relay_id, with_for_update=True)
    if row is None:
        return True
    never_sent = row.state == "queued"
    session.execute(delete(RelayedCommand).where(RelayedCommand.relay_id == relay_id))
    return never_sent


def forget_before(session: Session, cutoff: datetime) -> int:
    """Delete the rows queued before `cutoff`: no sender waits that long (a command's
    timeout is minutes at most), so they are the outcomes of senders that died."""
    result = session.execute(delete(RelayedCommand).where(RelayedCommand.created_at < cutoff))
    return int(getattr(result, "rowcount", 0) or 0)
