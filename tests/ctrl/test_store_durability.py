"""ctrl's SQLite store syncs every commit (issue 16, "Durability"): with
``synchronous=NORMAL`` in WAL mode an acknowledged write, and so a command ID's stored
result, could be lost on power loss, breaking the replay promise.  Every connection
the engine opens says FULL (2) or stronger."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

from kibotos.ctrl.store.db import make_engine


def test_every_sqlite_connection_syncs_each_commit(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'ctrl.db'}")
    try:
        for _ in range(3):  # a fresh connection each time, not just the first
            with engine.connect() as conn:
                assert conn.execute(text("PRAGMA synchronous")).scalar() >= 2
                assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
                conn.invalidate()
    finally:
        engine.dispose()
