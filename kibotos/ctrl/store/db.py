"""Opening the store, and the one place blocking SQL calls cross into trio.

SQLAlchemy is synchronous; every call goes through `Store.run`, which runs a function
with a fresh `Session` in a worker thread (`trio.to_thread.run_sync`).  SQLite gets WAL
mode and a busy timeout so the CLI's direct writes (``kibotos ctrl grant``) and the
serving process do not trip over each other.  Foreign errors are translated by
`map_sqlalchemy_errors`.

Writes on SQLite are serialised (one writer) and committed in groups: the writes that
queued up while the previous group ran share one worker-thread hop, one transaction and
one commit, each function run in arrival order exactly as it would have run alone
after the one before.  A caller resumes only after the commit that holds its write, so
nothing is acknowledged that a crash could lose.  When one function of a group raises,
the group is rolled back and every function runs again in its own transaction, so each
caller gets the outcome it would have had alone (the transaction functions are plain
store work, safe to run again after a rollback).

On PostgreSQL a serving ctrl's connections carry `SERVING_IDLE_IN_TRANSACTION_TIMEOUT`:
with several replicas, one that is stopped (SIGSTOP, a frozen VM) in the middle of a
transaction would otherwise hold its row locks (a node's ``FOR UPDATE`` of placement,
the relay queue's rows) for as long as its TCP connection looks alive, and every other
replica touching those rows would wait behind it.  The server aborts such a transaction
(SQLSTATE 25P03) and the stopped replica, once it runs again, gets `Unavailable`, as for
any other loss of the store.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import trio
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from kibotos.core.errors import Internal, Unavailable

T = TypeVar("T")


#: SQLite's ``synchronous`` setting for ctrl's store (bench/store_sync.py measures its
#: cost against NORMAL).
SQLITE_SYNCHRONOUS = "FULL"

#: How long (seconds) a serving ctrl's PostgreSQL transaction may sit idle between two
#: statements before the server aborts it (the module docstring).  A legitimate
#: transaction never waits inside itself: it is statements and the Python between them,
#: well under a second even on a loaded two-core host, and nothing awaits a node or
#: the network with a transaction open.  10 s is far above that and below the default
#: `session_timeout` (15 s), so a stopped replica's row locks are gone before the others
#: declare it gone and sweep its sessions.  The fenced singleton writes set a tighter
#: limit on their own (`kibotos.ctrl.model.replicas.FENCED_IDLE_TIMEOUT_MS`).
SERVING_IDLE_IN_TRANSACTION_TIMEOUT = 10.0

#: SQLSTATE of a transaction the server aborted for sitting idle too long.
IDLE_IN_TRANSACTION_TIMEOUT_SQLSTATE = "25P03"


def make_engine(url: str, *, idle_in_transaction_timeout: float | None = None) -> Engine:
    """An engine for `url`.  `idle_in_transaction_timeout` (seconds; PostgreSQL only)
    is set on every connection: what a serving ctrl passes (`open_store`), not the CLI's
    one-off commands or the migrations."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            # FULL: every commit is synced to disk before ctrl answers.  NORMAL syncs
            # WAL only at checkpoints, so an acknowledged write (and a command ID's
            # stored result, which a replay must return) could vanish on power loss.
            cur.execute(f"PRAGMA synchronous={SQLITE_SYNCHRONOUS}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    connect_args: dict[str, Any] = {}
    if idle_in_transaction_timeout is not None:
        millis = max(1, round(idle_in_transaction_timeout * 1000))
        connect_args["options"] = f"-c idle_in_transaction_session_timeout={millis}"
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20,
                         connect_args=connect_args)


@contextlib.contextmanager
def map_sqlalchemy_errors() -> Iterator[None]:
    try:
        yield
    except OperationalError as exc:
        raise Unavailable(f"store unavailable: {exc.orig}") from exc
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) == IDLE_IN_TRANSACTION_TIMEOUT_SQLSTATE:
            # This process stalled inside a transaction and the server ended it: the
            # transaction did not happen, the next one gets a fresh connection.
            raise Unavailable(f"store unavailable: {exc.orig}") from exc
        raise Internal(f"store error: {exc}") from exc
    except SQLAlchemyError as exc:
        raise Internal(f"store error: {exc}") from exc


class _Queued(Generic[T]):
    """One write waiting for its group commit, and then its outcome."""

    __slots__ = ("done", "error", "fn", "taken", "value")

    def __init__(self, fn: Callable[[Session], T]) -> None:
        self.fn = fn
        self.taken = False
        self.value: T | None = None
        self.error: Exception | None = None
        self.done = trio.Event()

    def outcome(self) -> T:
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


class Store:
    #: At most this many queued writes share one transaction.
    MAX_GROUP = 64

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        # SQLite allows one writer; serialising writes here avoids busy retries.
        self._sqlite = engine.dialect.name == "sqlite"
        self._write_lock = trio.Lock()
        self._queue: deque[_Queued[Any]] = deque()

    def session(self) -> Session:
        return self._sessions()

    def listen(self, name: str, fn: Callable[..., Any]) -> None:
        """Register a SQLAlchemy session event (``after_flush``, ``after_commit`` …) for
        the sessions of this store only, not for every Session in the process (several
        ctrl instances share a process in tests and benchmarks)."""
        event.listen(self._sessions, name, fn)

    def apply(self, fn: Callable[[Session], T], session: Session) -> T:
        """Run one transaction function inside an open transaction (the one place every
        function passes, for the benchmark's accounting)."""
        return fn(session)

    def run_sync(self, fn: Callable[[Session], T]) -> T:
        """Run `fn` in one transaction, committed if it returns, rolled back if it raises."""
        return self._transaction(fn)

    def _transaction(self, fn: Callable[[Session], T]) -> T:
        with map_sqlalchemy_errors(), self._sessions() as session, session.begin():
            return self.apply(fn, session)

    def run_group_sync(self, group: list[_Queued[Any]]) -> None:
        """Run queued writes in one transaction and store each outcome.  If a function
        raises, nothing of the group is kept and each runs again alone; if the commit
        fails, every write of the group failed with it."""
        if len(group) > 1:
            raised_in = None
            values: list[Any] = []
            try:
                with map_sqlalchemy_errors(), self._sessions() as session, session.begin():
                    for item in group:
                        raised_in = item
                        values.append(self.apply(item.fn, session))
                        session.flush()  # a flush error is this function's, not the group's
                    raised_in = None
            except Exception as exc:
                if raised_in is None:
                    for item in group:
                        item.error = exc
                    return
            else:
                for item, value in zip(group, values, strict=True):
                    item.value = value
                return
        for item in group:
            try:
                item.value = self._transaction(item.fn)
            except Exception as exc:
                item.error = exc

    async def run(self, fn: Callable[[Session], T]) -> T:
        return await trio.to_thread.run_sync(self.run_sync, fn)

    async def write(self, fn: Callable[[Session], T]) -> T:
        """Like `run`, for transactions that write: serialised and group-committed on
        SQLite (see the module docstring)."""
        if not self._sqlite:
            return await self.run(fn)
        item: _Queued[T] = _Queued(fn)
        self._queue.append(item)
        try:
            await self._write_lock.acquire()
        except trio.Cancelled:
            if not item.taken:
                self._queue.remove(item)
                raise
            # Already running in another caller's group: like a cancelled `run`, the
            # transaction finishes and its outcome is returned.
            with trio.CancelScope(shield=True):
                await item.done.wait()
            return item.outcome()
        try:
            if not item.taken:
                group: list[_Queued[Any]] = []
                while self._queue and len(group) < self.MAX_GROUP:
                    queued = self._queue.popleft()
                    queued.taken = True
                    group.append(queued)
                try:
                    await trio.to_thread.run_sync(self.run_group_sync, group)
                except BaseException:
                    for queued in group:  # the group never ran: nobody's write is kept
                        queued.error = Unavailable("the store write could not run")
                    raise
                finally:
                    for queued in group:
                        queued.done.set()
        finally:
            self._write_lock.release()
        return item.outcome()

    def close(self) -> None:
        self.engine.dispose()
