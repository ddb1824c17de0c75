"""the create path: an index on the Workspaces' layer pool and state

Revision ID: 0011_layer_pool_index
Revises: 0010_replicas

A create checks its pool's room twice (before the node is asked and in the create's
transaction), each a sum over the pool's Workspaces that are not DELETED; without this
index both scanned every Workspace (bench/placement.py).

"""
from collections.abc import Sequence

from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0011_layer_pool_index'
down_revision: str | Sequence[str] | None = '0010_replicas'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('workspaces') as batch:
        batch.create_index('ix_workspaces_layer_pool_state', ['layer_pool_id', 'state'],
                           unique=False)


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('workspaces') as batch:
        batch.drop_index('ix_workspaces_layer_pool_state')
