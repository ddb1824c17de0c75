"""volumes

Revision ID: 0005_volumes
Revises: 0004_storage_pools

Volumes (block files in a storage pool, attached to at most one Workspace with a guest
mount point) and the long operations on pool objects (expansion of a Volume or a
writable layer, moves between pools), recorded first so they resume after a restart
(docs/storage.md, "Volumes").

"""
from collections.abc import Sequence

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0005_volumes'
down_revision: str | Sequence[str] | None = '0004_storage_pools'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('volumes',
    sa.Column('volume_id', sa.String(length=32), nullable=False),
    sa.Column('pool_id', sa.String(length=63), nullable=False),
    sa.Column('capacity_bytes', sa.BigInteger(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('labels', sa.JSON(), nullable=False),
    sa.Column('workspace_id', sa.String(length=40), nullable=True),
    sa.Column('mount_point', sa.Text(), nullable=True),
    sa.Column('revision', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('volume_id')
    )
    with op.batch_alter_table('volumes', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_volumes_pool_id'), ['pool_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_volumes_state'), ['state'], unique=False)
        batch_op.create_index(batch_op.f('ix_volumes_workspace_id'), ['workspace_id'], unique=False)

    op.create_table('object_operations',
    sa.Column('object_kind', sa.String(length=16), nullable=False),
    sa.Column('object_id', sa.String(length=32), nullable=False),
    sa.Column('workspace_id', sa.String(length=40), nullable=True),
    sa.Column('op', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('pool_id', sa.String(length=63), nullable=False),
    sa.Column('capacity_bytes', sa.BigInteger(), nullable=False),
    sa.Column('target_pool_id', sa.String(length=63), nullable=True),
    sa.Column('target_capacity_bytes', sa.BigInteger(), nullable=True),
    sa.Column('node_id', sa.String(length=63), nullable=True),
    sa.Column('epoch', sa.BigInteger(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('object_kind', 'object_id')
    )
    with op.batch_alter_table('object_operations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_object_operations_status'), ['status'], unique=False)
        batch_op.create_index(batch_op.f('ix_object_operations_workspace_id'), ['workspace_id'], unique=False)


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('object_operations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_object_operations_workspace_id'))
        batch_op.drop_index(batch_op.f('ix_object_operations_status'))

    op.drop_table('object_operations')
    with op.batch_alter_table('volumes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_volumes_workspace_id'))
        batch_op.drop_index(batch_op.f('ix_volumes_state'))
        batch_op.drop_index(batch_op.f('ix_volumes_pool_id'))

    op.drop_table('volumes')
