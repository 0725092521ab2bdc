"""Replicas remember their hop's first-byte latency: ``replicas.first_byte_seconds``.

Why: ``ckpt tiers`` and each run's status page show what a tier delivers as the hops into it
measured it: the write bandwidth (``bytes`` over ``copy_seconds``, recorded since 0001) and how
long a hop waited before its first byte moved, which the catalog did not record. The copy
times it where it times the hop (``core.transfer.copy_part``) and the replica keeps it next to
the hop's duration. The index serves "the hops into tier T over the last day" as one range
scan, however many replicas the tier held before. Replicas copied before this revision have
no first-byte latency (NULL: shown as not measured).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("replicas", schema=None) as batch_op:
        batch_op.add_column(sa.Column("first_byte_seconds", sa.Float(), nullable=True))
        batch_op.create_index(batch_op.f("ix_replicas_tier_verified_at"), ["tier", "verified_at"], unique=False)


def downgrade() -> None:
    raise NotImplementedError("catalog migrations are forward-only")
