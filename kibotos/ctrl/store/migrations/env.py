"""alembic environment of ctrl's store.

ctrl runs migrations itself (`kibotos.ctrl.store.migrate.upgrade`), handing alembic an
open connection in ``config.attributes["connection"]``; no ``alembic.ini`` is read at run
time.  Developers generate a revision with
``alembic -c kibotos/ctrl/store/migrations/alembic.ini revision --autogenerate -m ...``
against a scratch database named by ``KIBOTOS_ALEMBIC_URL``.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection

from kibotos.ctrl.store.db import make_engine
from kibotos.ctrl.store.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    # SQLite cannot ALTER most things in place; batch mode rebuilds the table instead.
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = os.environ.get("KIBOTOS_ALEMBIC_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("set KIBOTOS_ALEMBIC_URL to the database to migrate")
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported")
run_migrations_online()
