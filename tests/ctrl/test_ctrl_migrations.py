"""The migrations create exactly the schema the models describe, on both backends."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from kibotos.ctrl.store import migrate
from kibotos.ctrl.store.db import make_engine
from kibotos.ctrl.store.models import Base


def test_migrated_schema_matches_models(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        migrate.upgrade(engine)
        with engine.connect() as conn:
            mc = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(mc, Base.metadata)
        assert diff == []
        assert migrate.current_revision(engine) == migrate.head_revision()
    finally:
        engine.dispose()


def test_upgrade_is_idempotent_and_keeps_data(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        migrate.upgrade(engine)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO events (at, subject, kind) VALUES ('2026-01-01 00:00:00', 's', 'k')")
        migrate.upgrade(engine)
        with engine.connect() as conn:
            count = conn.exec_driver_sql("SELECT count(*) FROM events").scalar()
        assert count == 1
        tables = set(inspect(engine).get_table_names())
        assert set(Base.metadata.tables) <= tables
    finally:
        engine.dispose()


def test_fresh_database_has_no_revision(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        assert migrate.current_revision(engine) is None
    finally:
        engine.dispose()
