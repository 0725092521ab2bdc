"""Replicas remember when their bytes were last read back: ``replicas.checked_at``.

Why: the scrub flow reads a share of the verified copies per run, least recently checked
first, so that every copy is read within a cycle. It kept "when was this replica last read
back" in a side file (``<data_dir>/scrub-state.json``) because the catalog had no such field,
and found the verified replicas by asking for each checkpoint's replicas in turn (one query per
checkpoint: slow at a million checkpoints, and the side file was per machine). The column
lives next to the state it describes; the index serves "verified replicas on tiers T, oldest
checked first" as one ordered, limited scan (state is an equality, the tier filter is applied
on the few rows read: nearly every verified replica is on a durable tier anyway).

``checked_at`` is stamped whenever a replica becomes verified (a fresh copy was just read back,
so it is not scrubbed again at once) and by ``Catalog.mark_checked``. Existing verified
replicas start from their ``verified_at``, which is what the scrub flow fell back to before.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('replicas', schema=None) as batch_op:
        batch_op.add_column(sa.Column('checked_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index(batch_op.f('ix_replicas_state_checked_at_id'), ['state', 'checked_at', 'id'],
                              unique=False)
    op.execute("UPDATE replicas SET checked_at = verified_at WHERE state = 'verified'")


def downgrade() -> None:
    raise NotImplementedError("catalog migrations are forward-only")
