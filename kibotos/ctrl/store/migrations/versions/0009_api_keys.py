"""api keys: the keys gateways' callers present, each of one team

Revision ID: 0009_api_keys
Revises: 0008_network

One row per key: its name, its team, sha256 of its secret (the key is shown once and
never stored), who created it and when it was revoked (docs/gateways.md).

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0009_api_keys'
down_revision: str | Sequence[str] | None = '0008_network'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        'api_keys',
        sa.Column('key_id', sa.String(length=40), nullable=False),
        sa.Column('name', sa.String(length=63), nullable=False),
        sa.Column('team', sa.String(length=63), nullable=False),
        sa.Column('secret_hash', sa.String(length=64), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('created_by', sa.String(length=40), nullable=True),
        sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint('key_id'))
    with op.batch_alter_table('api_keys') as batch:
        batch.create_index(batch.f('ix_api_keys_team'), ['team'], unique=False)


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('api_keys') as batch:
        batch.drop_index(batch.f('ix_api_keys_team'))
    op.drop_table('api_keys')
