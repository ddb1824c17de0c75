"""Group commit of store writes on SQLite (`kibotos.ctrl.store.db.Store.write`): the
writes that queue while one runs share a transaction, and each caller still gets
exactly the outcome it would have had alone, only after the commit holding its write.

The writes are held in a group on purpose: a first write blocks its worker thread on a
`threading.Event` until the others have queued behind it."""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from sqlalchemy import text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from kibotos.core.errors import FailedPrecondition, Internal, Unavailable
from kibotos.ctrl.store.db import Store, _Queued, make_engine


class RecordingStore(Store):
    """A real store that remembers the size of every group it ran."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.groups: list[int] = []

    def run_group_sync(self, group: list[_Queued[Any]]) -> None:
        self.groups.append(len(group))
        super().run_group_sync(group)


@pytest.fixture
def store(tmp_path: Path) -> RecordingStore:
    engine = make_engine(f"sqlite:///{tmp_path / 'group.db'}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE kv (k TEXT PRIMARY KEY, v INTEGER NOT NULL)"))
    return RecordingStore(engine)


def put(key: str, value: int, session: Session) -> str:
    if key.startswith("doomed"):
        session.info["doomed"] = True
    session.execute(text("INSERT INTO kv (k, v) VALUES (:k, :v)"), {"k": key, "v": value})
    return key


def refuse(key: str, session: Session) -> str:
    session.execute(text("INSERT INTO kv (k, v) VALUES (:k, 0)"), {"k": key})
    raise FailedPrecondition(f"{key} refused after writing")


def rows(store: Store) -> dict[str, int]:
    """What committed, read on a connection of its own."""
    with store.engine.connect() as conn:
        return {str(k): int(v) for k, v in conn.execute(text("SELECT k, v FROM kv"))}


async def grouped(store: RecordingStore, fns: list[Any]) -> list[Any]:
    """Run `fns` as writes queued behind a blocked first write; their outcomes (the
    value, or the exception raised) in order."""
    gate = threading.Event()

    def blocker(session: Session) -> str:
        gate.wait(30)
        return put("first", 0, session)

    outcomes: list[Any] = [None] * len(fns)

    async def one(i: int) -> None:
        try:
            outcomes[i] = await store.write(fns[i])
        except Exception as exc:
            outcomes[i] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.write, blocker)
        await trio.testing.wait_all_tasks_blocked()
        for i in range(len(fns)):
            nursery.start_soon(one, i)
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    return outcomes


async def test_queued_writes_share_one_transaction(store: RecordingStore) -> None:

    outcomes = await grouped(store, [partial(put, f"k{i}", i) for i in range(10)])
    assert outcomes == [f"k{i}" for i in range(10)]
    assert store.groups == [1, 10]
    assert rows(store) == {"first": 0, **{f"k{i}": i for i in range(10)}}


async def test_a_write_that_raises_fails_alone(store: RecordingStore) -> None:

    fns = [partial(put, "a", 1), partial(refuse, "bad"), partial(put, "b", 2)]
    outcomes = await grouped(store, fns)
    assert outcomes[0] == "a"
    assert outcomes[2] == "b"
    assert isinstance(outcomes[1], FailedPrecondition)
    # The group was rolled back and each ran again alone: the refusal wrote nothing.
    assert rows(store) == {"first": 0, "a": 1, "b": 2}


async def test_a_failed_commit_fails_every_write_of_the_group(
        store: RecordingStore) -> None:
    """Nothing is acknowledged before its commit: when the commit of a group fails (a
    crash at that point loses the same writes), every caller of the group gets the
    error and none of its writes is in the store."""

    def before_commit(session: Session) -> None:
        if session.info.get("doomed"):
            raise Unavailable("disk gone")

    store.listen("before_commit", before_commit)
    outcomes = await grouped(store, [partial(put, "k0", 0), partial(put, "doomed", 1),
                                     partial(put, "k2", 2)])
    assert store.groups == [1, 3]
    assert all(isinstance(o, Unavailable) for o in outcomes), outcomes
    assert rows(store) == {"first": 0}
    # The store is usable afterwards.
    assert await store.write(partial(put, "k3", 3)) == "k3"


async def test_a_cancelled_write_not_yet_taken_never_runs(store: RecordingStore) -> None:

    gate = threading.Event()

    def blocker(session: Session) -> str:
        gate.wait(30)
        return put("first", 0, session)

    scope = trio.CancelScope()

    async def cancelled() -> None:
        with scope:
            await store.write(partial(put, "cancelled", 2))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.write, blocker)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(cancelled)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(store.write, partial(put, "kept", 1))
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert rows(store) == {"first": 0, "kept": 1}
    assert store.groups == [1, 1]


async def test_writes_return_only_after_their_commit(store: RecordingStore) -> None:
    """Every write a caller saw return is visible to another connection at once."""

    seen: list[bool] = []

    async def one(i: int) -> None:
        key = await store.write(partial(put, f"k{i}", i))
        seen.append(key in rows(store))

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(one, i)
    assert seen == [True] * 20
    assert sum(store.groups) == 20


async def test_store_events_see_each_group_commit_once(store: RecordingStore) -> None:
    commits: list[int] = []
    store.listen("after_commit", lambda session: commits.append(1))

    await grouped(store, [partial(put, f"k{i}", i) for i in range(5)])
    assert len(commits) == 2  # the blocker's transaction, then the group's


class _Base(DeclarativeBase):
    pass


class KV(_Base):
    """The test table, mapped, for writes that only reach SQL at the flush."""

    __tablename__ = "kv"
    k: Mapped[str] = mapped_column(primary_key=True)
    v: Mapped[int]


def add(key: str, value: int, session: Session) -> str:
    session.add(KV(k=key, v=value))  # no SQL yet: a duplicate key fails at the flush
    return key


async def test_a_flush_error_belongs_to_its_write(store: RecordingStore) -> None:
    """A write whose pending rows fail only when flushed (here a duplicate key) fails
    alone, as it would in its own transaction; the others of its group commit."""
    await store.write(partial(put, "taken", 0))
    outcomes = await grouped(store, [partial(add, "a", 1), partial(add, "taken", 2),
                                     partial(add, "b", 3)])
    assert outcomes[0] == "a"
    assert outcomes[2] == "b"
    assert isinstance(outcomes[1], Internal)
    assert rows(store) == {"taken": 0, "first": 0, "a": 1, "b": 3}
