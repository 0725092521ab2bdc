"""ORM models of the catalog: the schema the migrations build, and nothing else.

Rows never leave ``db/``: ``db.catalog`` reads them with Core statements and returns the plain
values of ``db.entities``. Every query of the catalog issue has an index here (named in a
comment next to it). Times are stored in UTC and always come back timezone-aware.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Stable constraint names, so that migrations (batch mode on SQLite) can name what they alter.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator):
    """A timestamp stored in UTC and returned timezone-aware on every backend.

    SQLite has no time zone type: values are stored as naive UTC and tagged UTC on the way out.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def encode_metrics(metrics: Mapping[str, float]) -> dict[str, float | str]:
    """Metrics as the JSON column holds them: a non-finite value as the string ``"nan"``,
    ``"inf"`` or ``"-inf"``, since JSON has no token for it (PostgreSQL's ``json`` refuses
    Python's ``NaN``). A diverged run's checkpoint is still a checkpoint and must be recorded."""
    return {k: v if math.isfinite(v) else repr(float(v)) for k, v in metrics.items()}


def decode_metrics(stored: Mapping[str, float | str] | None) -> dict[str, float]:
    """``encode_metrics`` undone: every metric a float again, the non-finite ones included."""
    return {k: float(v) for k, v in (stored or {}).items()}


class Metrics(TypeDecorator):
    """A checkpoint's metrics in a JSON column, non-finite values included (``encode_metrics``):
    the one place where they are encoded and decoded, whatever reads or writes the column."""

    impl = JSON
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return None if value is None else encode_metrics(value)

    def process_result_value(self, value, dialect):
        return None if value is None else decode_metrics(value)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    __table__: ClassVar[Table]  # every model here maps one table (SQLAlchemy types it as any FromClause)


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    project: Mapped[str | None] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    config_digest: Mapped[str | None] = mapped_column(String(128))
    code_digest: Mapped[str | None] = mapped_column(String(128))
    tags: Mapped[dict] = mapped_column(JSON)
    # The run-level origin (resumed/fine-tuned/branched from this checkpoint). Kept as names so
    # a run can be created before its first checkpoint; the edge itself lives in ``lineage``.
    parent_run: Mapped[str | None] = mapped_column(String(128))
    parent_step: Mapped[int | None] = mapped_column(BigInteger)
    parent_relation: Mapped[str | None] = mapped_column(String(32))


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "step", "attempt"),  # queries 1, 7: a run's checkpoints by step
        Index(None, "state", "verified_tiers"),  # query 6: under-replicated by tier mask
        Index(None, "state", "committed_at"),  # query 10: committed, never promoted
        # reconcile's archive backlog: the marked checkpoints (few) by tier mask (migration 0006)
        Index("ix_checkpoints_milestone_backlog", "milestone_marks", "verified_tiers",
              sqlite_where=text("milestone_marks > 0"), postgresql_where=text("milestone_marks > 0")),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    step: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))
    format: Mapped[str] = mapped_column(String(32))
    parts: Mapped[int] = mapped_column(Integer)
    parts_registered: Mapped[int] = mapped_column(Integer)
    total_bytes: Mapped[int] = mapped_column(BigInteger)
    file_count: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict] = mapped_column(Metrics)
    tags: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    committed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    writer_stall_seconds: Mapped[float | None] = mapped_column(Float)
    # Bit t set <=> every part has a verified replica on tier t. Kept by the catalog on every
    # replica state change (in the same transaction), so "where is a complete copy" is a
    # column read instead of a GROUP BY over replicas.
    verified_tiers: Mapped[int] = mapped_column(Integer)
    # ``core.policy.milestone_marks`` of the recorded kind and tags, kept by registration (the
    # only writer of kind and tags): which checkpoints the job itself marked a milestone or an
    # epoch end, so the archive backlog is an index read of the marked ones (migration 0006).
    milestone_marks: Mapped[int] = mapped_column(SmallInteger, server_default=text("0"))
    # The training attempt (one launch of the job) whose parts make this checkpoint ('' for the
    # unnamed attempt); an older attempt's checkpoint above the step a newer one resumed from is
    # ``superseded_by`` that attempt: never offered for resume or restore again (migration 0009).
    attempt: Mapped[str] = mapped_column(String(128), server_default=text("''"))
    superseded_by: Mapped[str | None] = mapped_column(String(128))
    superseded_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class Attempt(Base):
    """One launch of a run's training job, and the step it resumed from (None: from scratch)."""

    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("run_id", "attempt"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # order of first record
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    attempt: Mapped[str] = mapped_column(String(128))
    resumed_from_step: Mapped[int | None] = mapped_column(BigInteger)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())


class TierRoot(Base):
    """The identity marker recorded for a tier root (``node`` is '' for the shared tiers): a root
    that does not show it is unavailable, never a verdict on the copies there."""

    __tablename__ = "tier_roots"

    tier: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    node: Mapped[str] = mapped_column(String(256), primary_key=True)
    url: Mapped[str] = mapped_column(String(2048))
    identity: Mapped[str] = mapped_column(String(64))
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime())


class CheckpointPart(Base):
    """One registered manifest: a node's share of a checkpoint."""

    __tablename__ = "checkpoint_parts"

    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"), primary_key=True)
    part: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[str | None] = mapped_column(String(256))
    manifest_digest: Mapped[str] = mapped_column(String(64))
    bytes: Mapped[int] = mapped_column(BigInteger)
    file_count: Mapped[int] = mapped_column(Integer)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime())


class CheckpointFile(Base):
    __tablename__ = "checkpoint_files"
    __table_args__ = (UniqueConstraint("checkpoint_id", "part", "path"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))
    part: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(1024))
    size: Mapped[int] = mapped_column(BigInteger)
    algorithm: Mapped[str] = mapped_column(String(16))
    checksum: Mapped[str] = mapped_column(String(128))


class Replica(Base):
    """One part of one checkpoint on one tier; its ``state`` follows db.entities.TRANSITIONS."""

    __tablename__ = "replicas"
    __table_args__ = (
        UniqueConstraint("checkpoint_id", "tier", "part"),  # queries 2, 3, 6, 7: a checkpoint's copies
        Index(None, "tier", "state", "id"),  # queries 7, 9; reconcile's vanished-copy sweep pages by id
        Index(None, "state", "checked_at", "id"),  # scrub: verified replicas, least recently read first
        Index(None, "tier", "verified_at"),  # ckpt tiers: the hops into a tier over the last day (0010)
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))
    tier: Mapped[int] = mapped_column(SmallInteger)
    part: Mapped[int] = mapped_column(Integer)
    node: Mapped[str | None] = mapped_column(String(256))
    url: Mapped[str] = mapped_column(String(2048))
    state: Mapped[str] = mapped_column(String(16))
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    verified_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    copy_seconds: Mapped[float | None] = mapped_column(Float)
    # the hop's wait from its start to the first byte read from its source (migration 0010)
    first_byte_seconds: Mapped[float | None] = mapped_column(Float)
    etag: Mapped[str | None] = mapped_column(String(256))
    version_id: Mapped[str | None] = mapped_column(String(256))
    claim_token: Mapped[str | None] = mapped_column(String(64))
    lease_seconds: Mapped[float | None] = mapped_column(Float)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # Last time the bytes were read back and matched the catalog: stamped on entering
    # ``verified`` and by the scrub (``Catalog.mark_checked``); migration 0003.
    checked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class TierCompletion(Base):
    """The first observation that a checkpoint was complete on a tier (``complete_on_tier``),
    and whether the work that follows it (archive, durable event, status page, retention) is
    done: ``followups_done_at``, under a lease while a caller does it (migration 0008)."""

    __tablename__ = "tier_completions"
    __table_args__ = (
        # the follow-ups backlog reconcile reads: only the unfinished completions (few)
        Index("ix_tier_completions_followups_due", "tier", "completed_at",
              sqlite_where=text("followups_done_at IS NULL"), postgresql_where=text("followups_done_at IS NULL")),
    )

    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"), primary_key=True)
    tier: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    completed_at: Mapped[datetime] = mapped_column(UTCDateTime())
    actor: Mapped[str] = mapped_column(String(256))
    followups_done_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    followups_lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime())


class Lineage(Base):
    """Edge child -> parent (``follows``, ``resumed_from``, ``fine_tuned_from``, ``branched_from``)."""

    __tablename__ = "lineage"
    __table_args__ = (Index(None, "parent_id"),)  # query 5: descendants walk parent -> child

    child_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"), primary_key=True)  # query 4
    parent_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"), primary_key=True)
    relation: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Pin(Base):
    __tablename__ = "pins"

    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"), primary_key=True)
    reason: Mapped[str | None] = mapped_column(Text)
    actor: Mapped[str] = mapped_column(String(256))
    pinned_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Alias(Base):
    __tablename__ = "aliases"
    __table_args__ = (Index(None, "checkpoint_id"),)  # prune guard: is this checkpoint aliased

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))
    set_at: Mapped[datetime] = mapped_column(UTCDateTime())


class AuditLog(Base):
    """Every state change: when, who (flow-run id, ``cli``, ``agent:<node>``), what, why."""

    __tablename__ = "audit_log"
    __table_args__ = (
        Index(None, "run", "step", "id"),  # query 8: a checkpoint's history
        Index(None, "at"),  # audit retention: rows older than the retention, oldest first
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime())
    actor: Mapped[str] = mapped_column(String(256))
    subject: Mapped[str] = mapped_column(String(512))
    action: Mapped[str] = mapped_column(String(32))
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str | None] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    run: Mapped[str | None] = mapped_column(String(128))
    step: Mapped[int | None] = mapped_column(BigInteger)


class Drill(Base):
    """A timed restore drill of one checkpoint from one tier."""

    __tablename__ = "drills"
    __table_args__ = (Index(None, "checkpoint_id"), Index(None, "at"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))
    tier: Mapped[int] = mapped_column(SmallInteger)
    ok: Mapped[bool] = mapped_column(Boolean)
    seconds: Mapped[float] = mapped_column(Float)
    bytes: Mapped[int] = mapped_column(BigInteger)
    at: Mapped[datetime] = mapped_column(UTCDateTime())
    detail: Mapped[str | None] = mapped_column(Text)
    actor: Mapped[str] = mapped_column(String(256))
    # a cluster drill (0009): nodes that resumed at once, bytes read per tier {"tier": n}, each
    # node's seconds to its part loaded, and the bytes over the tier's measured bandwidth
    nodes: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    bound_seconds: Mapped[float | None] = mapped_column(Float)
    tier_bytes: Mapped[dict | None] = mapped_column(JSON)
    node_seconds: Mapped[list | None] = mapped_column(JSON)


class Rejection(Base):
    """A part refused for a permanent reason (corrupt or malformed manifest, bad input, conflict),
    recorded once per content: the key includes the digest of the manifest that was refused
    (``core.manifest.attempt_digest``), so the same bytes are not re-judged on every reconcile
    pass, and a re-save with another manifest is a new attempt. The run need not be known."""

    __tablename__ = "rejections"

    run: Mapped[str] = mapped_column(String(128), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    part: Mapped[int] = mapped_column(Integer, primary_key=True)
    manifest_digest: Mapped[str] = mapped_column(String(80), primary_key=True)
    node: Mapped[str | None] = mapped_column(String(256))
    reason: Mapped[str] = mapped_column(Text)
    rejected_at: Mapped[datetime] = mapped_column(UTCDateTime())
    actor: Mapped[str] = mapped_column(String(256))


class SweepCursor(Base):
    """Where a periodic sweep that visits a bounded slice per pass stopped (e.g. reconcile's
    check for vanished copies, by replica id), so the next pass, on any machine, goes on from
    there and the whole table is covered in rotation."""

    __tablename__ = "sweep_cursors"

    name: Mapped[str] = mapped_column(String(256), primary_key=True)
    position: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
