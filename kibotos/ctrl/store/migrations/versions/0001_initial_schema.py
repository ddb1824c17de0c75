"""initial schema

Revision ID: 0001
Revises: (none)

The tables of kibotos.ctrl.store.models as first released: identities, enrollment
grants, nodes, cluster settings, the command journal and the event log.

"""
from collections.abc import Sequence

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0001'
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('cluster_settings',
    sa.Column('key', sa.String(length=64), nullable=False),
    sa.Column('value', sa.JSON(), nullable=False),
    sa.Column('version', sa.BigInteger(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('key')
    )
    op.create_table('commands',
    sa.Column('command_id', sa.String(length=128), nullable=False),
    sa.Column('operation', sa.String(length=64), nullable=False),
    sa.Column('input_digest', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('result', sa.JSON(), nullable=True),
    sa.Column('error', sa.JSON(), nullable=True),
    sa.Column('identity_id', sa.String(length=40), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('command_id')
    )
    op.create_table('enrollment_grants',
    sa.Column('grant_id', sa.String(length=40), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('node_id', sa.String(length=63), nullable=True),
    sa.Column('name', sa.String(length=128), nullable=True),
    sa.Column('secret_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('created_by', sa.String(length=40), nullable=True),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('used_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('identity_id', sa.String(length=40), nullable=True),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('grant_id')
    )
    op.create_table('events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('subject', sa.String(length=80), nullable=False),
    sa.Column('kind', sa.String(length=64), nullable=False),
    sa.Column('detail', sa.JSON(), nullable=True),
    sa.Column('text', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_events_subject'), ['subject'], unique=False)

    op.create_table('identities',
    sa.Column('identity_id', sa.String(length=40), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('node_id', sa.String(length=63), nullable=True),
    sa.Column('name', sa.String(length=128), nullable=True),
    sa.Column('grant_id', sa.String(length=40), nullable=False),
    sa.Column('public_key', sa.String(length=128), nullable=False),
    sa.Column('secret_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('identity_id')
    )
    with op.batch_alter_table('identities', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_identities_node_id'), ['node_id'], unique=False)

    op.create_table('nodes',
    sa.Column('node_id', sa.String(length=63), nullable=False),
    sa.Column('admission', sa.String(length=16), nullable=False),
    sa.Column('drain_requested', sa.Boolean(), nullable=False),
    sa.Column('isolated_incarnation', sa.BigInteger(), nullable=True),
    sa.Column('retired_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('registration_version', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('incarnation', sa.BigInteger(), nullable=True),
    sa.Column('session_id', sa.String(length=40), nullable=True),
    sa.Column('session_alive', sa.Boolean(), nullable=False),
    sa.Column('session_started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('session_ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('release_version', sa.String(length=64), nullable=True),
    sa.Column('source_revision', sa.String(length=64), nullable=True),
    sa.Column('clock_offset_ms', sa.Double(), nullable=True),
    sa.Column('clock_uncertainty_ms', sa.Double(), nullable=True),
    sa.Column('clock_sync_status', sa.String(length=32), nullable=True),
    sa.Column('clock_measured_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('report_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('resources_cpu_millis', sa.BigInteger(), nullable=False),
    sa.Column('resources_memory_bytes', sa.BigInteger(), nullable=False),
    sa.Column('allocated_cpu_millis', sa.BigInteger(), nullable=False),
    sa.Column('allocated_memory_bytes', sa.BigInteger(), nullable=False),
    sa.Column('instance_count', sa.Integer(), nullable=False),
    sa.Column('volume_count', sa.Integer(), nullable=False),
    sa.Column('memory_tight', sa.Boolean(), nullable=False),
    sa.Column('memory_tight_since', sa.DateTime(timezone=True), nullable=True),
    sa.Column('host_usage', sa.JSON(), nullable=True),
    sa.Column('host_usage_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('dataplane_address', sa.String(length=255), nullable=True),
    sa.Column('node_facts', sa.JSON(), nullable=True),
    sa.Column('overcommit_cpu', sa.Integer(), nullable=True),
    sa.Column('overcommit_memory', sa.Integer(), nullable=True),
    sa.Column('overcommit_sent_serial', sa.BigInteger(), nullable=False),
    sa.Column('overcommit_confirmed_serial', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('node_id')
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table('nodes')
    with op.batch_alter_table('identities', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_identities_node_id'))

    op.drop_table('identities')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_events_subject'))

    op.drop_table('events')
    op.drop_table('enrollment_grants')
    op.drop_table('commands')
    op.drop_table('cluster_settings')
