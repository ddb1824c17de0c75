"""storage pools

Revision ID: 0004_storage_pools
Revises: 0003_workspaces

What ctrl remembers about a storage pool ID: the capacity the operator set (NULL = not
set), the registered marker instance and the node holding the registration, and the
lost state set by ``kibo storage-pool declare-lost`` (docs/storage.md, "Storage pools in
ctrl").

"""
from collections.abc import Sequence

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0004_storage_pools'
down_revision: str | Sequence[str] | None = '0003_workspaces'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('storage_pools',
    sa.Column('pool_id', sa.String(length=63), nullable=False),
    sa.Column('capacity_bytes', sa.BigInteger(), nullable=True),
    sa.Column('instance', sa.String(length=64), nullable=True),
    sa.Column('registered_node_id', sa.String(length=63), nullable=True),
    sa.Column('lost_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('lost_instance', sa.String(length=64), nullable=True),
    sa.Column('revision', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('pool_id')
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table('storage_pools')
