"""Opening the store, and the one place blocking SQL calls cross into trio.

SQLAlchemy is synchronous; every call goes through `Store.run`, which runs a function
with a fresh `Session` in a worker thread (`trio.to_thread.run_sync`).  SQLite gets WAL
mode and a busy timeout so the CLI's direct writes (``kibotos ctrl grant``) and the
serving process do not trip over each other.  Foreign errors are translated by
`map_sqlalchemy_errors`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import trio
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from kibotos.errors import Internal, Unavailable

T = TypeVar("T")


def default_url(state_dir: Path) -> str:
    return f"sqlite:///{state_dir / 'ctrl.db'}"


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


@contextlib.contextmanager
def map_sqlalchemy_errors() -> Iterator[None]:
    try:
        yield
    except OperationalError as exc:
        raise Unavailable(f"store unavailable: {exc.orig}") from exc
    except SQLAlchemyError as exc:
        raise Internal(f"store error: {exc}") from exc


class Store:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        # SQLite allows one writer; serialising writes here avoids busy retries.
        self._sqlite = engine.dialect.name == "sqlite"
        self._write_lock = trio.Lock()

    def session(self) -> Session:
        return self._sessions()

    def listen(self, name: str, fn: Callable[..., Any]) -> None:
        """Register a SQLAlchemy session event (``after_flush``, ``after_commit`` …) for
        the sessions of this store only, not for every Session in the process (several
        ctrl instances share a process in tests and benchmarks)."""
        event.listen(self._sessions, name, fn)

    def run_sync(self, fn: Callable[[Session], T]) -> T:
        """Run `fn` in one transaction, committed if it returns, rolled back if it raises."""
        with map_sqlalchemy_errors(), self._sessions() as session, session.begin():
            return fn(session)

    async def run(self, fn: Callable[[Session], T]) -> T:
        return await trio.to_thread.run_sync(self.run_sync, fn)

    async def write(self, fn: Callable[[Session], T]) -> T:
        """Like `run`, for transactions that write: serialised on SQLite."""
        if not self._sqlite:
            return await self.run(fn)
        async with self._write_lock:
            return await self.run(fn)

    def close(self) -> None:
        self.engine.dispose()
