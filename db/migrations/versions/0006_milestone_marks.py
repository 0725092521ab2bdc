"""The archive backlog reads the marked checkpoints only: ``checkpoints.milestone_marks``.

Why: reconcile asks on every pass (with Tier 2) for the milestones complete on Tier 1 and not on
Tier 2. Whether a checkpoint is a milestone was decided from its kind, its tags (JSON) and its
step, so the query read every checkpoint complete on Tier 1 and not on Tier 2 and tested each
(slow at a million checkpoints, with nothing to archive: docs/benchmarks.md). The
policy-free part of that rule (``core.policy.milestone_marks``: marked by the job as a milestone,
by kind or tag; an epoch end) is now a column written with the kind and tags at registration,
and a partial index holds only the marked checkpoints by tier mask: the backlog is an index
read of the marked checkpoints not yet on Tier 2, whatever the catalog holds.

Existing checkpoints get their marks here: by kind in one UPDATE, and those whose tags mention
``milestone`` (found by a text match, then judged by the same rule as registration) one by one.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# the rule as of this revision (``core.policy.milestone_marks``), frozen: a migration must not
# change meaning when the code does
TAGGED, EPOCH = 1, 2
TRUE_WORDS = ("1", "true", "yes", "milestone")


def _marks(kind: str, tags: dict | None) -> int:
    tagged = kind == "milestone" or str((tags or {}).get("milestone", "")).lower() in TRUE_WORDS
    return (TAGGED if tagged else 0) | (EPOCH if kind == "epoch" else 0)


def upgrade() -> None:
    # a plain ALTER TABLE ADD COLUMN (SQLite allows it with a constant default), not a batch: a
    # batch recreates the table on SQLite, which its referencing rows forbid (and at a million rows
    # would copy them all)
    op.add_column('checkpoints', sa.Column('milestone_marks', sa.SmallInteger(), server_default=sa.text('0'),
                                           nullable=False))
    op.execute(f"UPDATE checkpoints SET milestone_marks = CASE kind WHEN 'milestone' THEN {TAGGED} "
               f"ELSE {EPOCH} END WHERE kind IN ('milestone', 'epoch')")
    ck = sa.table('checkpoints', sa.column('id', sa.Integer), sa.column('kind', sa.String),
                  sa.column('tags', sa.JSON), sa.column('milestone_marks', sa.SmallInteger))
    conn = op.get_bind()
    tagged = conn.execute(sa.select(ck.c.id, ck.c.kind, ck.c.tags)
                          .where(sa.cast(ck.c.tags, sa.Text).contains('milestone'))).all()
    changed = [dict(b_id=i, marks=_marks(kind, tags)) for i, kind, tags in tagged]
    if changed:
        conn.execute(sa.update(ck).where(ck.c.id == sa.bindparam('b_id')).values(milestone_marks=sa.bindparam('marks')),
                     changed)
    op.create_index('ix_checkpoints_milestone_backlog', 'checkpoints', ['milestone_marks', 'verified_tiers'],
                    unique=False, sqlite_where=sa.text('milestone_marks > 0'),
                    postgresql_where=sa.text('milestone_marks > 0'))


def downgrade() -> None:
    raise NotImplementedError("catalog migrations are forward-only")
