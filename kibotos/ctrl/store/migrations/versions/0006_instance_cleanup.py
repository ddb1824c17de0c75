"""instance cleanup: pending releases and stored results

Revision ID: 0006_instance_cleanup
Revises: 0005_volumes

A release stuck on the node (``cleanup_pending_since``, ``cleanup_held``) and the moment
ctrl stored the cleanup result from the node's record of an ended Instance before
having the node delete it (``cleanup_stored_at``; docs/workspaces.md, cleanup-status).

"""
from collections.abc import Sequence

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0006_instance_cleanup'
down_revision: str | Sequence[str] | None = '0005_volumes'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('instances') as batch:
        batch.add_column(sa.Column('cleanup_pending_since', sa.DateTime(timezone=True),
                                   nullable=True))
        batch.add_column(sa.Column('cleanup_held', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('cleanup_stored_at', sa.DateTime(timezone=True),
                                   nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('instances') as batch:
        batch.drop_column('cleanup_stored_at')
        batch.drop_column('cleanup_held')
        batch.drop_column('cleanup_pending_since')
