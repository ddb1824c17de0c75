"""The templates table's migration: one alembic head, and the columns the Workspace
code reads (docs/architecture.md, "Templates and the artifact store")."""

from __future__ import annotations

from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from kibotos.ctrl.store import migrate
from kibotos.ctrl.store.db import make_engine


def test_migrations_have_exactly_one_head() -> None:
    # Two engineers adding revisions on the same parent make two heads, and
    # `upgrade head` then refuses to run: the chain must stay linear.
    script = ScriptDirectory.from_config(migrate.alembic_config())
    heads = script.get_heads()
    assert len(heads) == 1, f"alembic has several heads: {heads}"
    revisions = list(script.walk_revisions())
    assert revisions[-1].down_revision is None
    assert any(r.revision == "0002_templates" for r in revisions)


def test_templates_table_has_the_contract_columns(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        migrate.upgrade(engine)
        columns = {c["name"] for c in inspect(engine).get_columns("templates")}
        assert {"name", "image_digest", "image_size", "kernel_digest", "initramfs_digest",
                "created_at", "revision"} <= columns
    finally:
        engine.dispose()
