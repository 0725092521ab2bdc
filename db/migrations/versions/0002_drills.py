"""Restore drills: one row per timed restore of a checkpoint from a tier.

Why: the drill flow proves that restores work and measures the recovery time; its results must
outlive the Prefect flow-run history and be queryable next to the checkpoints they exercised.
A separate revision (rather than folding it into 0001) keeps the forward-only chain honest
for catalogs created before drills existed.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('drills',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('checkpoint_id', sa.Integer(), nullable=False),
    sa.Column('tier', sa.SmallInteger(), nullable=False),
    sa.Column('ok', sa.Boolean(), nullable=False),
    sa.Column('seconds', sa.Float(), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('detail', sa.Text(), nullable=True),
    sa.Column('actor', sa.String(length=256), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], name=op.f('fk_drills_checkpoint_id_checkpoints')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_drills'))
    )
    with op.batch_alter_table('drills', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_drills_at'), ['at'], unique=False)
        batch_op.create_index(batch_op.f('ix_drills_checkpoint_id'), ['checkpoint_id'], unique=False)



def downgrade() -> None:
    raise NotImplementedError("catalog migrations are forward-only")
