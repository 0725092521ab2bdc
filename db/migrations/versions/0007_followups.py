"""A checkpoint's follow-ups are recorded done: ``tier_completions.followups_done_at``.

Why: the work that follows a checkpoint becoming complete on Tier 1 (the inline archive of a
milestone, the ``ckpt.checkpoint.durable`` event, the run's status page, retention) ran only
for the caller that recorded the completion. A promotion killed right after that commit left
them undone for good: every retry, duplicate event and reconcile saw the completion recorded and
did nothing. Now the completion row also says whether its follow-ups finished
(``followups_done_at``) and who is doing them (``followups_lease_until``, a lease any caller may
take over once it lapses), so a retry, a duplicate or reconcile finishes them. A partial index
holds only the unfinished ones, so reconcile's backlog read costs the same at any catalog size.

Completions recorded before this revision are taken as done (their follow-ups ran or were
abandoned long ago; re-running retention and events for the whole history is not wanted).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ADD COLUMNs (nullable), not a batch: a batch recreates the table on SQLite
    op.add_column("tier_completions", sa.Column("followups_done_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("tier_completions", sa.Column("followups_lease_until", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE tier_completions SET followups_done_at = completed_at")
    op.create_index("ix_tier_completions_followups_due", "tier_completions", ["tier", "completed_at"],
                    unique=False, sqlite_where=sa.text("followups_done_at IS NULL"),
                    postgresql_where=sa.text("followups_done_at IS NULL"))


def downgrade() -> None:
    raise NotImplementedError("catalog migrations are forward-only")
