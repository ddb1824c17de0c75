"""Several ctrl replicas on one PostgreSQL store: their heartbeats, the singleton lease
and which replica holds each node's session (docs/replicas.md).

Every time here is the database's clock (``now()`` of the transaction), never a
replica's: replicas on different hosts disagree about the time, the database is the
one clock they share, so "expired" means the same to all of them.

The lease is a row with a fencing token rather than a PostgreSQL advisory lock: an
advisory lock is held by a connection, so a holder that is stopped (SIGSTOP, a stalled
VM) keeps it for as long as its TCP connection looks alive and nobody else may take
over, while a lease row expires on the database's clock.  Expiry alone is not enough,
since a stalled holder that wakes up does not know it lost the lease: every write of
the singleton work calls `check_fence` in its own transaction, which reads the lease
row ``FOR SHARE`` and refuses a token that is no longer current (or expired).  The
share lock orders that write before any takeover (whose ``FOR UPDATE`` waits for it),
and ``idle_in_transaction_session_timeout`` makes the server abort the transaction of
a holder stopped between its check and its commit, so a stopped holder blocks a
takeover for at most `FENCED_IDLE_TIMEOUT_MS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.orm import Session

from kibotos.core.errors import Unavailable
from kibotos.ctrl.model import nodes
from kibotos.ctrl.store import relay_queue
from kibotos.ctrl.store.models import CtrlLease, CtrlReplica, Node
from kibotos.ctrl.wire.base import as_utc

#: The name of the one lease row (created by the migration).
SINGLETON = "singleton"
#: Relayed commands older than this are the outcomes of senders that died.
RELAYED_COMMAND_LIFETIME = 3600.0
#: How long the server lets a fenced transaction sit idle before aborting it.
FENCED_IDLE_TIMEOUT_MS = 2000


class FencedOut(Unavailable):
    """This replica's lease token is no longer the current one (another replica took
    over, or the lease expired): the singleton write it guarded must not happen."""


@dataclass(frozen=True)
class Lease:
    """The lease as `acquire` left it for this replica."""

    token: int
    #: Seconds of the lease left, by the database's clock, when it was granted.
    ttl: float
    #: Whether this call changed the holder (a takeover or the first grant).
    taken_over: bool


def _postgresql(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def db_now(session: Session) -> datetime:
    """The database's clock; SQLite (one process on one host) has the host's."""
    if _postgresql(session):
        return as_utc(session.execute(select(func.now())).scalar_one())
    return datetime.now(UTC)


def register(session: Session, replica_id: str, listen: str) -> None:
    """A replica starting (or one that was declared gone, coming back)."""
    now = db_now(session)
    row = session.get(CtrlReplica, replica_id, with_for_update=True)
    if row is None:
        session.add(CtrlReplica(replica_id=replica_id, listen=listen, started_at=now,
                                heartbeat_at=now))
    else:
        row.heartbeat_at = now


def heartbeat(session: Session, replica_id: str) -> bool:
    """Renew this replica's liveness; False when it was declared gone meanwhile (its
    node sessions were ended: it must close them and register again)."""
    result = session.execute(update(CtrlReplica)
                             .where(CtrlReplica.replica_id == replica_id)
                             .values(heartbeat_at=db_now(session)))
    return int(getattr(result, "rowcount", 0) or 0) == 1


def acquire(session: Session, replica_id: str, ttl: float) -> Lease | None:
    """Take or renew the lease for `ttl` seconds; None while another replica holds an
    unexpired one.  A new holder gets the next token."""
    now = db_now(session)
    lease = session.get(CtrlLease, SINGLETON, with_for_update=True)
    if lease is None:
        raise Unavailable("the store has no singleton lease row: migrate it")
    expired = lease.expires_at is None or as_utc(lease.expires_at) <= now
    if lease.holder != replica_id and not expired:
        return None
    taken_over = lease.holder != replica_id or expired
    if taken_over:
        lease.token += 1
        lease.holder = replica_id
    lease.expires_at = now + timedelta(seconds=ttl)
    return Lease(token=lease.token, ttl=ttl, taken_over=taken_over)


def release(session: Session, replica_id: str, token: int) -> None:
    """A clean shutdown: give the lease up at once instead of letting it expire."""
    session.execute(update(CtrlLease)
                    .where(CtrlLease.name == SINGLETON, CtrlLease.holder == replica_id,
                           CtrlLease.token == token)
                    .values(expires_at=None))


def leave(session: Session, replica_id: str) -> None:
    """A clean shutdown: this replica's row goes (its sessions were closed)."""
    session.execute(delete(CtrlReplica).where(CtrlReplica.replica_id == replica_id))


def check_fence(session: Session, token: int) -> None:
    """Raise `FencedOut` unless `token` is the current, unexpired lease token.  Call it
    first in every transaction of the singleton work (the module docstring)."""
    if _postgresql(session):
        session.execute(text(f"SET LOCAL idle_in_transaction_session_timeout = "
                             f"{FENCED_IDLE_TIMEOUT_MS}"))
    now = db_now(session)
    lease = session.get(CtrlLease, SINGLETON, with_for_update={"read": True})
    if lease is None or lease.token != token:
        raise FencedOut(f"lease token {token} is no longer current: another ctrl replica "
                        "took over the singleton work")
    if lease.expires_at is None or as_utc(lease.expires_at) <= now:
        raise FencedOut(f"the lease of token {token} expired")


def end_sessions_of_gone_replicas(session: Session, token: int, timeout: float) -> list[str]:
    """The lease holder's sweep: delete the replicas whose heartbeat is older than
    `timeout`, end the live sessions held by no live replica (theirs, and those of
    replicas that left), and forget relayed commands nobody waits for any more.
    Returns the node IDs whose session it ended."""
    check_fence(session, token)
    now = db_now(session)
    cutoff = now - timedelta(seconds=timeout)
    session.execute(delete(CtrlReplica).where(CtrlReplica.heartbeat_at < cutoff))
    live = set(session.scalars(select(CtrlReplica.replica_id)))
    ended: list[str] = []
    candidates = session.scalars(select(Node).where(Node.session_alive.is_(True))
                                 .with_for_update())
    for node in candidates:
        if node.session_replica in live:
            continue
        node.session_alive = False
        node.session_ended_at = now
        nodes.bump(node)
        nodes.record_event(session, now, node.node_id, "session.ended",
                           {"reason": "ctrl_replica_gone", "replica": node.session_replica})
        ended.append(node.node_id)
    relay_queue.forget_before(session, now - timedelta(seconds=RELAYED_COMMAND_LIFETIME))
    return ended
