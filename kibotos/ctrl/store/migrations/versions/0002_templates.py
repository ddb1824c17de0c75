"""templates

Revision ID: 0002_templates
Revises: 0001

The Template table: a name pointing at three blobs of the artifact store (image,
kernel, initramfs) by digest, with a revision that grows when the name is repointed.

"""
from collections.abc import Sequence

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0002_templates'
down_revision: str | Sequence[str] | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('templates',
    sa.Column('name', sa.String(length=63), nullable=False),
    sa.Column('image_digest', sa.String(length=71), nullable=False),
    sa.Column('image_size', sa.BigInteger(), nullable=False),
    sa.Column('kernel_digest', sa.String(length=71), nullable=False),
    sa.Column('initramfs_digest', sa.String(length=71), nullable=False),
    sa.Column('source', sa.JSON(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revision', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table('templates')
