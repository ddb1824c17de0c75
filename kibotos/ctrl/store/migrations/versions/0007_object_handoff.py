"""object handoff: how a writable layer or a Volume last changed hands

Revision ID: 0007_object_handoff
Revises: 0006_instance_cleanup

``workspaces.layer_handoff`` and ``volumes.handoff``: CLEAN, or UNKNOWN when the node
opened the object without the previous holder's release receipt (spec:
storage-pools-on-nfs, "Moving a pool to another host"); NULL before any handoff.

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0007_object_handoff'
down_revision: str | Sequence[str] | None = '0006_instance_cleanup'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('workspaces') as batch:
        batch.add_column(sa.Column('layer_handoff', sa.String(length=16), nullable=True))
    with op.batch_alter_table('volumes') as batch:
        batch.add_column(sa.Column('handoff', sa.String(length=16), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('volumes') as batch:
        batch.drop_column('handoff')
    with op.batch_alter_table('workspaces') as batch:
        batch.drop_column('layer_handoff')
