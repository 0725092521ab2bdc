"""A drill at cluster shape: ``drills.nodes``, ``bound_seconds``, ``tier_bytes``, ``node_seconds``.

Why: a restart is every node loading its own part at once, not one machine restoring the whole
checkpoint. A cluster drill starts N processes that resume their parts together and records,
on the drill's one row: how many nodes took part (``nodes``; 1 for the single-restore drills
recorded before), the bytes read from each tier (``tier_bytes``, JSON ``{"tier": bytes}``),
each node's time from the common start to its part loaded (``node_seconds``, JSON list), and
the bound the tier allows (``bound_seconds``: the bytes over the tier's bandwidth measured in
the same drill). ``seconds`` stays the recovery time: first start to last part loaded. Rows of
older drills keep NULLs, which read as "not measured".

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ADD COLUMNs (constant default or NULL): no batch copy of the table on SQLite
    op.add_column('drills', sa.Column('nodes', sa.Integer(), server_default=sa.text('1'), nullable=False))
    op.add_column('drills', sa.Column('bound_seconds', sa.Float(), nullable=True))
    op.add_column('drills', sa.Column('tier_bytes', sa.JSON(), nullable=True))
    op.add_column('drills', sa.Column('node_seconds', sa.JSON(), nullable=True))


def downgrade() -> None:
    raise NotImplementedError("catalog migrations are forward-only")
