"""Rejected parts are a recorded state: ``rejections``.

Why: a part refused for a permanent reason (a malformed or conflicting manifest, bad input)
left only an audit row, so reconcile, which finds committed parts on Tier 0 by their manifests,
promoted it again on every pass: a new audit row and a ``ckpt.checkpoint.rejected`` event a
minute, forever, and the checkpoint never showed as rejected. The table records each refusal
once, keyed by (run, step, part, digest of the refused manifest): reconcile skips a part whose
current manifest is recorded there, and a re-save with a different manifest is judged afresh.
The run is a name, not a foreign key: a part of an unknown run is refused too.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('rejections',
    sa.Column('run', sa.String(length=128), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('part', sa.Integer(), nullable=False),
    sa.Column('manifest_digest', sa.String(length=80), nullable=False),
    sa.Column('node', sa.String(length=256), nullable=True),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('rejected_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('actor', sa.String(length=256), nullable=False),
    sa.PrimaryKeyConstraint('run', 'step', 'part', 'manifest_digest', name=op.f('pk_rejections'))
    )


def downgrade() -> None:
    raise NotImplementedError("catalog migrations are forward-only")
