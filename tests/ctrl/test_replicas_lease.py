"""The rows of several ctrl replicas on a real PostgreSQL server: the singleton lease and
its fencing token, heartbeats, and the sweep that ends only the sessions of replicas
that are gone (`kibotos.ctrl.model.replicas`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import pytest
from sqlalchemy import Engine, select, text, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from kibotos.ctrl.model import replicas as rep
from kibotos.ctrl.store import migrate, relay_queue
from kibotos.ctrl.store.db import make_engine
from kibotos.ctrl.store.models import CtrlLease, CtrlReplica, Node, RelayedCommand

pytestmark = pytest.mark.postgres
T = TypeVar("T")


@pytest.fixture
def engine(postgres_url: str) -> Iterator[Engine]:
    engine = make_engine(postgres_url)
    migrate.upgrade(engine)
    try:
        yield engine
    finally:
        engine.dispose()


def txn(engine: Engine, fn: Callable[[Session], T]) -> T:
    with Session(engine) as session, session.begin():
        return fn(session)


def expire_lease(engine: Engine) -> None:
    """What the passing of the lease's time does, without waiting for it."""
    txn(engine, lambda s: s.execute(update(CtrlLease).values(
        expires_at=datetime.now(UTC) - timedelta(seconds=1))))


def test_one_holder_at_a_time_and_the_token_grows_at_each_takeover(engine: Engine) -> None:
    first = txn(engine, lambda s: rep.acquire(s, "rep-a", 10.0))
    assert first is not None
    assert first.taken_over
    assert first.token == 1
    assert txn(engine, lambda s: rep.acquire(s, "rep-b", 10.0)) is None
    renewed = txn(engine, lambda s: rep.acquire(s, "rep-a", 10.0))
    assert renewed is not None
    assert renewed.token == 1
    assert not renewed.taken_over
    txn(engine, lambda s: rep.check_fence(s, 1))

    expire_lease(engine)
    # The holder itself may not act on an expired lease, even before anyone took over.
    with pytest.raises(rep.FencedOut, match="expired"):
        txn(engine, lambda s: rep.check_fence(s, 1))
    second = txn(engine, lambda s: rep.acquire(s, "rep-b", 10.0))
    assert second is not None
    assert second.taken_over
    assert second.token == 2
    with pytest.raises(rep.FencedOut, match="another ctrl replica took over"):
        txn(engine, lambda s: rep.check_fence(s, 1))
    txn(engine, lambda s: rep.check_fence(s, 2))
    assert txn(engine, lambda s: rep.acquire(s, "rep-a", 10.0)) is None


def test_a_release_lets_another_take_over_at_once(engine: Engine) -> None:
    lease = txn(engine, lambda s: rep.acquire(s, "rep-a", 60.0))
    assert lease is not None
    txn(engine, lambda s: rep.release(s, "rep-a", lease.token))
    taken = txn(engine, lambda s: rep.acquire(s, "rep-b", 60.0))
    assert taken is not None
    assert taken.token == lease.token + 1


def test_a_holder_stalled_inside_a_fenced_write_cannot_commit_after_a_takeover(
        engine: Engine) -> None:
    """A holder stopped between its fence check and its commit: the server aborts its
    idle transaction, the takeover goes ahead, and the stalled write never lands."""
    lease = txn(engine, lambda s: rep.acquire(s, "rep-a", 60.0))
    assert lease is not None
    txn(engine, lambda s: rep.register(s, "rep-a", "127.0.0.1:1"))
    outcome: list[BaseException | None] = []
    checked = threading.Event()

    def stalled_holder() -> None:
        try:
            with Session(engine) as session, session.begin():
                rep.check_fence(session, lease.token)
                session.execute(update(CtrlReplica).values(listen="stalled write"))
                checked.set()
                # Stopped: longer than the server lets a fenced transaction idle.
                time.sleep(rep.FENCED_IDLE_TIMEOUT_MS / 1000 * 2)
        except BaseException as exc:  # what the stalled write met, checked below
            outcome.append(exc)
        else:
            outcome.append(None)

    holder = threading.Thread(target=stalled_holder)
    holder.start()
    try:
        assert checked.wait(30)
        expire_lease(engine)
        taken = txn(engine, lambda s: rep.acquire(s, "rep-b", 60.0))
    finally:
        holder.join(60)
    assert taken is not None
    assert taken.token == lease.token + 1
    assert len(outcome) == 1
    assert isinstance(outcome[0], DBAPIError)
    assert "idle-in-transaction" in str(outcome[0])
    listens = txn(engine, lambda s: list(s.scalars(text("SELECT listen FROM ctrl_replicas"))))
    assert listens == ["127.0.0.1:1"]


def test_heartbeat_tells_a_replica_it_was_declared_gone(engine: Engine) -> None:
    txn(engine, lambda s: rep.register(s, "rep-a", "127.0.0.1:1"))
    assert txn(engine, lambda s: rep.heartbeat(s, "rep-a")) is True
    txn(engine, lambda s: rep.leave(s, "rep-a"))
    assert txn(engine, lambda s: rep.heartbeat(s, "rep-a")) is False
    txn(engine, lambda s: rep.register(s, "rep-a", "127.0.0.1:1"))
    assert txn(engine, lambda s: rep.heartbeat(s, "rep-a")) is True


def _node(node_id: str, replica: str | None, alive: bool = True) -> Node:
    return Node(node_id=node_id, created_at=datetime.now(UTC), session_id=f"ses-{node_id}",
                session_alive=alive, session_replica=replica, incarnation=1)


def test_only_the_sessions_of_gone_replicas_are_ended(engine: Engine) -> None:
    def setup(session: Session) -> None:
        rep.register(session, "rep-live", "127.0.0.1:1")
        rep.register(session, "rep-gone", "127.0.0.1:2")
        session.add_all([_node("node-a", "rep-live"), _node("node-b", "rep-gone"),
                         _node("node-c", None), _node("node-d", "rep-left"),
                         _node("node-e", "rep-gone", alive=False)])

    txn(engine, setup)
    for relay_id in ("rly-old", "rly-new"):
        txn(engine, lambda s, r=relay_id: relay_queue.enqueue(
            s, r, "node-a", "rep-live", "instance.stop", {}, 30.0))
    txn(engine, lambda s: s.execute(
        update(RelayedCommand).where(RelayedCommand.relay_id == "rly-old")
        .values(created_at=datetime.now(UTC) - timedelta(hours=2))))
    # rep-gone's last heartbeat is older than the session timeout.
    txn(engine, lambda s: s.execute(
        update(CtrlReplica).where(CtrlReplica.replica_id == "rep-gone")
        .values(heartbeat_at=datetime.now(UTC) - timedelta(seconds=30))))
    lease = txn(engine, lambda s: rep.acquire(s, "rep-live", 10.0))
    assert lease is not None
    ended = txn(engine, lambda s: rep.end_sessions_of_gone_replicas(s, lease.token, 15.0))
    assert sorted(ended) == ["node-b", "node-c", "node-d"]
    alive = txn(engine, lambda s: {n.node_id: n.session_alive
                                   for n in s.query(Node).order_by(Node.node_id)})
    assert alive == {"node-a": True, "node-b": False, "node-c": False, "node-d": False,
                     "node-e": False}
    # The relayed command nobody can be waiting for any more is forgotten.
    assert txn(engine, lambda s: list(s.scalars(select(RelayedCommand.relay_id)))) == [
        "rly-new"]
    assert txn(engine, lambda s: rep.heartbeat(s, "rep-gone")) is False
    assert txn(engine, lambda s: rep.heartbeat(s, "rep-live")) is True
    # A replica that lost the lease cannot run the sweep.
    expire_lease(engine)
    with pytest.raises(rep.FencedOut):
        txn(engine, lambda s: rep.end_sessions_of_gone_replicas(s, lease.token, 15.0))
