"""workspaces

Revision ID: 0003_workspaces
Revises: 0002_templates

Workspaces and their labels, Instances (one per start), Allocations (CPU and memory an
Instance holds on its node) and the use rights of pool objects with their epochs
(docs/architecture.md, "Workspaces, Instances, use rights").

"""
from collections.abc import Sequence

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0003_workspaces'
down_revision: str | Sequence[str] | None = '0002_templates'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('allocations',
    sa.Column('instance_id', sa.String(length=40), nullable=False),
    sa.Column('node_id', sa.String(length=63), nullable=False),
    sa.Column('workspace_id', sa.String(length=40), nullable=False),
    sa.Column('cpu_millis', sa.BigInteger(), nullable=False),
    sa.Column('memory_bytes', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('released_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('instance_id')
    )
    with op.batch_alter_table('allocations', schema=None) as batch_op:
        batch_op.create_index('ix_allocations_node_released', ['node_id', 'released_at'], unique=False)

    op.create_table('instances',
    sa.Column('instance_id', sa.String(length=40), nullable=False),
    sa.Column('workspace_id', sa.String(length=40), nullable=False),
    sa.Column('node_id', sa.String(length=63), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('cpu_millis', sa.BigInteger(), nullable=False),
    sa.Column('memory_bytes', sa.BigInteger(), nullable=False),
    sa.Column('guest', sa.JSON(), nullable=True),
    sa.Column('confirmed_on_disk', sa.Boolean(), nullable=True),
    sa.Column('runtime_status', sa.String(length=16), nullable=False),
    sa.Column('attachment_status', sa.String(length=16), nullable=False),
    sa.Column('residual_status', sa.String(length=16), nullable=False),
    sa.Column('cleanup_source', sa.String(length=16), nullable=False),
    sa.Column('cleanup_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('instance_id')
    )
    with op.batch_alter_table('instances', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_instances_node_id'), ['node_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_instances_workspace_id'), ['workspace_id'], unique=False)

    op.create_table('use_rights',
    sa.Column('object_kind', sa.String(length=16), nullable=False),
    sa.Column('object_id', sa.String(length=32), nullable=False),
    sa.Column('workspace_id', sa.String(length=40), nullable=False),
    sa.Column('pool_id', sa.String(length=63), nullable=False),
    sa.Column('pool_shared', sa.Boolean(), nullable=False),
    sa.Column('holder_node_id', sa.String(length=63), nullable=True),
    sa.Column('last_holder_node_id', sa.String(length=63), nullable=True),
    sa.Column('epoch', sa.BigInteger(), nullable=False),
    sa.Column('bump_on_grant', sa.Boolean(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('object_kind', 'object_id')
    )
    with op.batch_alter_table('use_rights', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_use_rights_holder_node_id'), ['holder_node_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_use_rights_workspace_id'), ['workspace_id'], unique=False)

    op.create_table('workspace_labels',
    sa.Column('workspace_id', sa.String(length=40), nullable=False),
    sa.Column('key', sa.String(length=63), nullable=False),
    sa.Column('value', sa.String(length=63), nullable=False),
    sa.PrimaryKeyConstraint('workspace_id', 'key')
    )
    with op.batch_alter_table('workspace_labels', schema=None) as batch_op:
        batch_op.create_index('ix_workspace_labels_key_value', ['key', 'value'], unique=False)

    op.create_table('workspaces',
    sa.Column('workspace_id', sa.String(length=40), nullable=False),
    sa.Column('template_name', sa.String(length=63), nullable=False),
    sa.Column('image_digest', sa.String(length=71), nullable=False),
    sa.Column('kernel_digest', sa.String(length=71), nullable=False),
    sa.Column('initramfs_digest', sa.String(length=71), nullable=False),
    sa.Column('labels', sa.JSON(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('revision', sa.BigInteger(), nullable=False),
    sa.Column('cpu_millis', sa.BigInteger(), nullable=False),
    sa.Column('memory_bytes', sa.BigInteger(), nullable=False),
    sa.Column('layer_size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('layer_pool_id', sa.String(length=63), nullable=False),
    sa.Column('layer_ref', sa.String(length=32), nullable=False),
    sa.Column('current_instance_id', sa.String(length=40), nullable=True),
    sa.Column('node_id', sa.String(length=63), nullable=True),
    sa.Column('last_instance_id', sa.String(length=40), nullable=True),
    sa.Column('last_node_id', sa.String(length=63), nullable=True),
    sa.Column('stop_force', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('workspace_id')
    )
    with op.batch_alter_table('workspaces', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_workspaces_current_instance_id'), ['current_instance_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_workspaces_node_id'), ['node_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_workspaces_state'), ['state'], unique=False)



def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('workspaces', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_workspaces_state'))
        batch_op.drop_index(batch_op.f('ix_workspaces_node_id'))
        batch_op.drop_index(batch_op.f('ix_workspaces_current_instance_id'))

    op.drop_table('workspaces')
    with op.batch_alter_table('workspace_labels', schema=None) as batch_op:
        batch_op.drop_index('ix_workspace_labels_key_value')

    op.drop_table('workspace_labels')
    with op.batch_alter_table('use_rights', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_use_rights_workspace_id'))
        batch_op.drop_index(batch_op.f('ix_use_rights_holder_node_id'))

    op.drop_table('use_rights')
    with op.batch_alter_table('instances', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_instances_workspace_id'))
        batch_op.drop_index(batch_op.f('ix_instances_node_id'))

    op.drop_table('instances')
    with op.batch_alter_table('allocations', schema=None) as batch_op:
        batch_op.drop_index('ix_allocations_node_released')

    op.drop_table('allocations')
