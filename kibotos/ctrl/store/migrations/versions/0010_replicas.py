"""ctrl replicas: the replicas sharing a store, the singleton lease, session holders

Revision ID: 0010_replicas
Revises: 0009_api_keys

``ctrl_replicas`` holds each running ctrl's heartbeat; ``ctrl_lease`` the one lease row
(created here, so replicas never race to insert it) with its fencing token; and
``nodes.session_replica`` names the replica holding a node's session, and
``relayed_commands`` queues node commands for the replica holding the node's session
(docs/replicas.md).

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0010_replicas'
down_revision: str | Sequence[str] | None = '0009_api_keys'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        'ctrl_replicas',
        sa.Column('replica_id', sa.String(length=40), nullable=False),
        sa.Column('listen', sa.String(length=255), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('replica_id'))
    lease = op.create_table(
        'ctrl_lease',
        sa.Column('name', sa.String(length=40), nullable=False),
        sa.Column('holder', sa.String(length=40), nullable=True),
        sa.Column('token', sa.BigInteger(), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint('name'))
    op.bulk_insert(lease, [{'name': 'singleton', 'holder': None, 'token': 0,
                            'expires_at': None}])
    op.create_table(
        'relayed_commands',
        sa.Column('relay_id', sa.String(length=40), nullable=False),
        sa.Column('node_id', sa.String(length=63), nullable=False),
        sa.Column('replica_id', sa.String(length=40), nullable=False),
        sa.Column('kind', sa.String(length=64), nullable=False),
        sa.Column('args', sa.JSON(), nullable=False),
        sa.Column('timeout_s', sa.Double(), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('result', sa.JSON(), nullable=True),
        sa.Column('error', sa.JSON(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('relay_id'))
    with op.batch_alter_table('relayed_commands') as batch:
        batch.create_index(batch.f('ix_relayed_commands_replica_id'), ['replica_id'],
                           unique=False)
    with op.batch_alter_table('nodes') as batch:
        batch.add_column(sa.Column('session_replica', sa.String(length=40), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('nodes') as batch:
        batch.drop_column('session_replica')
    op.drop_table('relayed_commands')
    op.drop_table('ctrl_lease')
    op.drop_table('ctrl_replicas')
