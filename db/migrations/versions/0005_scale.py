"""Periodic work proportional to what changed: a sweep cursor, a paging index, an audit index.

Why: reconcile checked every verified replica against its tier on every pass (one query per
checkpoint, one listing per replica: at a million checkpoints a pass never ends). It now checks
a bounded slice per pass and remembers where it stopped in ``sweep_cursors`` (shared by every
node for the shared tiers), so the table is covered in rotation. The slice is "verified
replicas on tier T after id X, by id": ``ix_replicas_tier_state_id`` serves it as one range
scan on PostgreSQL too (SQLite's indexes carry the rowid already; PostgreSQL's do not, so the
old ``(tier, state)`` index gave an unordered match to sort), and still serves every query
the ``(tier, state)`` index served. The audit log grows by every state change and now has a
retention (rows older than it are exported, then deleted): ``ix_audit_log_at`` finds them, and
serves ``ckpt audit --since``.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('sweep_cursors',
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('position', sa.BigInteger(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_sweep_cursors'))
    )
    with op.batch_alter_table('replicas', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_replicas_tier_state'))
        batch_op.create_index(batch_op.f('ix_replicas_tier_state_id'), ['tier', 'state', 'id'], unique=False)
    with op.batch_alter_table('audit_log', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_audit_log_at'), ['at'], unique=False)


def downgrade() -> None:
    raise NotImplementedError("catalog migrations are forward-only")
