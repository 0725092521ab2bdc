"""Every checkpoint's attempt has its row in ``attempts``.

Why: the attempt rules (``db.attempts``) read a run's history from its ``attempts`` rows: which
launches resumed and from where, and which are older than a launch that never resumed. The
checkpoints recorded before revision 0009 (the unnamed attempt ``''``) had none, so a new launch
that never resumed could save above such a history as the run's newest, and the rules would
otherwise have to scan a run's checkpoints on every registration to find attempts without a
row. Each (run, attempt) that checkpoints name and ``attempts`` lacks gets its row here, first
recorded when its earliest checkpoint was, resumed from nowhere known (as a first part records
it). From this revision on every path that records a checkpoint records its attempt's row.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        INSERT INTO attempts (run_id, attempt, resumed_from_step, started_at)
        SELECT c.run_id, c.attempt, NULL, MIN(c.created_at) FROM checkpoints c
        WHERE NOT EXISTS (SELECT 1 FROM attempts a WHERE a.run_id = c.run_id AND a.attempt = c.attempt)
        GROUP BY c.run_id, c.attempt
    """)


def downgrade() -> None:
    raise NotImplementedError("catalog migrations are forward-only")
