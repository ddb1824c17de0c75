"""Bringing the store's schema to the newest revision, from inside ctrl.

ctrl calls `upgrade` at every start (and `kibotos ctrl grant` before it writes), so an
operator never runs alembic by hand.  The alembic configuration is built in code and
points at the migrations shipped inside the package; no ``alembic.ini`` is read.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from kibotos.ctrl.store.db import map_sqlalchemy_errors

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    with map_sqlalchemy_errors(), engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine) -> None:
    """Migrate the database behind `engine` to the head revision, in one transaction
    where the database allows it (PostgreSQL and SQLite both run DDL transactionally)."""
    cfg = alembic_config()
    with map_sqlalchemy_errors(), engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
