"""Identity: a checkpoint's attempt, the attempts of a run, and the identity of each tier root.

Why: the catalog verified every byte but not which history or which storage the bytes belong
to. A checkpoint is now the parts of one training *attempt* (one launch of the job):
``checkpoints.attempt`` joins the unique key (run, step, attempt), so a new attempt may save a
step again without ever being combined with an older attempt's parts. ``attempts`` records each
attempt of a run and the step it resumed from; when an attempt resumes from step S, the older
attempts' checkpoints above S are marked ``superseded_by`` that attempt (never offered for
resume or restore again, retired later with that reason). ``tier_roots`` records the identity
marker written at each tier root (per node for Tier 0), so a root that is missing or is not
the mount it should be is told apart from the tier itself.

Checkpoints recorded before this revision belong to the unnamed attempt ``''``.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # SQLite cannot drop a unique constraint: the batch recreates ``checkpoints``, which other
    # tables reference (``db.catalog.upgrade`` migrates SQLite with foreign keys off, then checks them)
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.add_column(sa.Column("attempt", sa.String(length=128), server_default=sa.text("''"),
                                      nullable=False))
        batch_op.add_column(sa.Column("superseded_by", sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column("superseded_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.drop_constraint("uq_checkpoints_run_id_step", type_="unique")
        batch_op.create_unique_constraint(batch_op.f("uq_checkpoints_run_id_step_attempt"),
                                          ["run_id", "step", "attempt"])
    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.String(length=128), nullable=False),
        sa.Column("resumed_from_step", sa.BigInteger(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_attempts_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempts")),
        sa.UniqueConstraint("run_id", "attempt", name=op.f("uq_attempts_run_id_attempt")),
    )
    op.create_table(
        "tier_roots",
        sa.Column("tier", sa.SmallInteger(), nullable=False),
        sa.Column("node", sa.String(length=256), nullable=False),
        sa.Column("url", sa.String(length=2048), nullable=False),
        sa.Column("identity", sa.String(length=64), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tier", "node", name=op.f("pk_tier_roots")),
    )


def downgrade() -> None:
    raise NotImplementedError("catalog migrations are forward-only")
