"""Initial catalog schema: runs, checkpoints, their parts and files, replicas, lineage, pins,
aliases, tier completions and the audit log.

Why: the catalog is the system's memory from the first checkpoint on (issue 2); every later
change to it must be a forward migration, so the schema starts life under Alembic too. The
indexes are the ones the ten catalog queries need (see db/models.py).

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('audit_log',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('actor', sa.String(length=256), nullable=False),
    sa.Column('subject', sa.String(length=512), nullable=False),
    sa.Column('action', sa.String(length=32), nullable=False),
    sa.Column('from_state', sa.String(length=16), nullable=True),
    sa.Column('to_state', sa.String(length=16), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('run', sa.String(length=128), nullable=True),
    sa.Column('step', sa.BigInteger(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_audit_log'))
    )
    with op.batch_alter_table('audit_log', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_audit_log_run_step_id'), ['run', 'step', 'id'], unique=False)

    op.create_table('runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('project', sa.String(length=256), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('config_digest', sa.String(length=128), nullable=True),
    sa.Column('code_digest', sa.String(length=128), nullable=True),
    sa.Column('tags', sa.JSON(), nullable=False),
    sa.Column('parent_run', sa.String(length=128), nullable=True),
    sa.Column('parent_step', sa.BigInteger(), nullable=True),
    sa.Column('parent_relation', sa.String(length=32), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs')),
    sa.UniqueConstraint('name', name=op.f('uq_runs_name'))
    )
    op.create_table('checkpoints',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('format', sa.String(length=32), nullable=False),
    sa.Column('parts', sa.Integer(), nullable=False),
    sa.Column('parts_registered', sa.Integer(), nullable=False),
    sa.Column('total_bytes', sa.BigInteger(), nullable=False),
    sa.Column('file_count', sa.Integer(), nullable=False),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.Column('tags', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('committed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('writer_stall_seconds', sa.Float(), nullable=True),
    sa.Column('verified_tiers', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_checkpoints_run_id_runs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_checkpoints')),
    sa.UniqueConstraint('run_id', 'step', name=op.f('uq_checkpoints_run_id_step'))
    )
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoints_state_committed_at'), ['state', 'committed_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_checkpoints_state_verified_tiers'), ['state', 'verified_tiers'], unique=False)

    op.create_table('aliases',
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('checkpoint_id', sa.Integer(), nullable=False),
    sa.Column('set_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], name=op.f('fk_aliases_checkpoint_id_checkpoints')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_aliases_run_id_runs')),
    sa.PrimaryKeyConstraint('run_id', 'name', name=op.f('pk_aliases'))
    )
    with op.batch_alter_table('aliases', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_aliases_checkpoint_id'), ['checkpoint_id'], unique=False)

    op.create_table('checkpoint_files',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('checkpoint_id', sa.Integer(), nullable=False),
    sa.Column('part', sa.Integer(), nullable=False),
    sa.Column('path', sa.String(length=1024), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('algorithm', sa.String(length=16), nullable=False),
    sa.Column('checksum', sa.String(length=128), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], name=op.f('fk_checkpoint_files_checkpoint_id_checkpoints')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_checkpoint_files')),
    sa.UniqueConstraint('checkpoint_id', 'part', 'path', name=op.f('uq_checkpoint_files_checkpoint_id_part_path'))
    )
    op.create_table('checkpoint_parts',
    sa.Column('checkpoint_id', sa.Integer(), nullable=False),
    sa.Column('part', sa.Integer(), nullable=False),
    sa.Column('node', sa.String(length=256), nullable=True),
    sa.Column('manifest_digest', sa.String(length=64), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('file_count', sa.Integer(), nullable=False),
    sa.Column('registered_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], name=op.f('fk_checkpoint_parts_checkpoint_id_checkpoints')),
    sa.PrimaryKeyConstraint('checkpoint_id', 'part', name=op.f('pk_checkpoint_parts'))
    )
    op.create_table('lineage',
    sa.Column('child_id', sa.Integer(), nullable=False),
    sa.Column('parent_id', sa.Integer(), nullable=False),
    sa.Column('relation', sa.String(length=32), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['child_id'], ['checkpoints.id'], name=op.f('fk_lineage_child_id_checkpoints')),
    sa.ForeignKeyConstraint(['parent_id'], ['checkpoints.id'], name=op.f('fk_lineage_parent_id_checkpoints')),
    sa.PrimaryKeyConstraint('child_id', 'parent_id', name=op.f('pk_lineage'))
    )
    with op.batch_alter_table('lineage', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_lineage_parent_id'), ['parent_id'], unique=False)

    op.create_table('pins',
    sa.Column('checkpoint_id', sa.Integer(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('actor', sa.String(length=256), nullable=False),
    sa.Column('pinned_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], name=op.f('fk_pins_checkpoint_id_checkpoints')),
    sa.PrimaryKeyConstraint('checkpoint_id', name=op.f('pk_pins'))
    )
    op.create_table('replicas',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('checkpoint_id', sa.Integer(), nullable=False),
    sa.Column('tier', sa.SmallInteger(), nullable=False),
    sa.Column('part', sa.Integer(), nullable=False),
    sa.Column('node', sa.String(length=256), nullable=True),
    sa.Column('url', sa.String(length=2048), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=True),
    sa.Column('verified_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('copy_seconds', sa.Float(), nullable=True),
    sa.Column('etag', sa.String(length=256), nullable=True),
    sa.Column('version_id', sa.String(length=256), nullable=True),
    sa.Column('claim_token', sa.String(length=64), nullable=True),
    sa.Column('lease_seconds', sa.Float(), nullable=True),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], name=op.f('fk_replicas_checkpoint_id_checkpoints')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_replicas')),
    sa.UniqueConstraint('checkpoint_id', 'tier', 'part', name=op.f('uq_replicas_checkpoint_id_tier_part'))
    )
    with op.batch_alter_table('replicas', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_replicas_tier_state'), ['tier', 'state'], unique=False)

    op.create_table('tier_completions',
    sa.Column('checkpoint_id', sa.Integer(), nullable=False),
    sa.Column('tier', sa.SmallInteger(), nullable=False),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('actor', sa.String(length=256), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], name=op.f('fk_tier_completions_checkpoint_id_checkpoints')),
    sa.PrimaryKeyConstraint('checkpoint_id', 'tier', name=op.f('pk_tier_completions'))
    )


def downgrade() -> None:
    raise NotImplementedError("catalog migrations are forward-only")
