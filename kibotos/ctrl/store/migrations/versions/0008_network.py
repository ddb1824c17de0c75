"""network: Workspace network policies, Egresses and Resolvers

Revision ID: 0008_network
Revises: 0007_object_handoff

A Workspace's network policy and its revision (NULL policy = the deployment default),
the Egress and Resolver names it references (indexed for the delete refusals), the
policy in force on each Instance and its guest's addresses; the Egress, Egress revision
(with the sealed password) and Resolver tables (docs/network.md).

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0008_network'
down_revision: str | Sequence[str] | None = '0007_object_handoff'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('workspaces') as batch:
        batch.add_column(sa.Column('network_policy', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('network_revision', sa.BigInteger(), nullable=False,
                                   server_default=sa.text('1')))
        batch.add_column(sa.Column('network_egress', sa.String(length=63), nullable=True))
        batch.add_column(sa.Column('network_resolver', sa.String(length=63), nullable=True))
        batch.create_index(batch.f('ix_workspaces_network_egress'), ['network_egress'],
                           unique=False)
        batch.create_index(batch.f('ix_workspaces_network_resolver'), ['network_resolver'],
                           unique=False)
    with op.batch_alter_table('instances') as batch:
        batch.add_column(sa.Column('network', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('network_revision', sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column('addresses', sa.JSON(), nullable=True))
    op.create_table(
        'egresses',
        sa.Column('name', sa.String(length=63), nullable=False),
        sa.Column('address', sa.String(length=255), nullable=False),
        sa.Column('username', sa.String(length=255), nullable=True),
        sa.Column('revision', sa.BigInteger(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('name'))
    op.create_table(
        'egress_revisions',
        sa.Column('name', sa.String(length=63), nullable=False),
        sa.Column('revision', sa.BigInteger(), nullable=False),
        sa.Column('address', sa.String(length=255), nullable=False),
        sa.Column('username', sa.String(length=255), nullable=True),
        sa.Column('password_sealed', sa.Text(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('name', 'revision'))
    op.create_table(
        'resolvers',
        sa.Column('name', sa.String(length=63), nullable=False),
        sa.Column('upstream', sa.String(length=255), nullable=False),
        sa.Column('via_egress', sa.String(length=63), nullable=True),
        sa.Column('revision', sa.BigInteger(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('name'))
    with op.batch_alter_table('resolvers') as batch:
        batch.create_index(batch.f('ix_resolvers_via_egress'), ['via_egress'], unique=False)


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('resolvers') as batch:
        batch.drop_index(batch.f('ix_resolvers_via_egress'))
    op.drop_table('resolvers')
    op.drop_table('egress_revisions')
    op.drop_table('egresses')
    with op.batch_alter_table('instances') as batch:
        batch.drop_column('addresses')
        batch.drop_column('network_revision')
        batch.drop_column('network')
    with op.batch_alter_table('workspaces') as batch:
        batch.drop_index(batch.f('ix_workspaces_network_resolver'))
        batch.drop_index(batch.f('ix_workspaces_network_egress'))
        batch.drop_column('network_resolver')
        batch.drop_column('network_egress')
        batch.drop_column('network_revision')
        batch.drop_column('network_policy')
