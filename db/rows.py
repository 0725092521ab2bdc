"""Core table handles, shared SELECTs and the row -> entity conversions of the catalog.

ORM rows never leave ``db/``: everything the catalog returns is built here from Core rows.
"""

from __future__ import annotations

from datetime import datetime
from functools import cache
from types import SimpleNamespace
from typing import Any

from sqlalchemy import Executable, Select, Table, func, select
from sqlalchemy.engine import Connection, Row

from core.errors import NotFound, UnknownRun
from core.layout import check_ref
from core.tiers import ALL_TIERS
from db.entities import AuditEntry, CheckpointInfo, DrillResult, FileInfo, ReplicaInfo, RunInfo
from db.models import (
    Alias,
    AuditLog,
    Base,
    Checkpoint,
    CheckpointFile,
    CheckpointPart,
    Drill,
    Lineage,
    Pin,
    Rejection,
    Replica,
    Run,
    SweepCursor,
    TierCompletion,
    TierRoot,
)

runs = Run.__table__
checkpoints = Checkpoint.__table__
parts = CheckpointPart.__table__
files = CheckpointFile.__table__
replicas = Replica.__table__
completions = TierCompletion.__table__
lineage = Lineage.__table__
pins = Pin.__table__
aliases = Alias.__table__
audit = AuditLog.__table__
drills = Drill.__table__
rejections = Rejection.__table__
cursors = SweepCursor.__table__
tier_roots = TierRoot.__table__

__all__ = ["ALL_TIERS"]  # the catalog's tier numbers are core.tiers.Tier's


def tier_bit(tier: int) -> int:
    return 1 << tier


# --- selects ---------------------------------------------------------------------------
def checkpoint_select() -> Select:
    return select(checkpoints, runs.c.name.label("run_name")).select_from(
        checkpoints.join(runs, checkpoints.c.run_id == runs.c.id))


def replica_select() -> Select:
    return select(replicas, checkpoints.c.step, checkpoints.c.attempt, runs.c.name.label("run_name")).select_from(
        replicas.join(checkpoints, replicas.c.checkpoint_id == checkpoints.c.id)
        .join(runs, checkpoints.c.run_id == runs.c.id))


def run_row(conn: Connection, name: str, *, lock: bool = False, with_clock: bool = False) -> Row:
    """The run's row; ``with_clock`` adds the server's ``now()`` as ``catalog_now`` (PostgreSQL:
    the catalog's clock read in the same round trip)."""
    stmt = (select(runs, func.now().label("catalog_now")) if with_clock else select(runs)).where(runs.c.name == name)
    row = conn.execute(stmt.with_for_update() if lock else stmt).one_or_none()
    if row is None:
        raise UnknownRun(f"unknown run {name!r}: it is not in the catalog")
    return row


def live_first() -> tuple[Any, ...]:
    """The order that puts first, among a step's checkpoints, the one a step names without an
    attempt: one never superseded (at most one per step), else the one recorded last. Told by
    ``superseded_at``, which a superseded checkpoint keeps once it is retired: a late part of an
    older attempt, superseded then retired, never stands for the step a newer attempt saved."""
    return checkpoints.c.superseded_at.is_not(None).asc(), checkpoints.c.id.desc()


def checkpoint_row(conn: Connection, run: str, step: int, *, attempt: str | None = None, lock: bool = False) -> Row:
    """The checkpoint of ``run`` at ``step`` written by ``attempt``; ``attempt`` None: the one
    never superseded (``live_first``)."""
    check_ref(step)  # a step no catalog column holds is bad input, not a driver's OverflowError
    stmt = checkpoint_select().where(runs.c.name == run, checkpoints.c.step == step)
    if attempt is not None:
        stmt = stmt.where(checkpoints.c.attempt == attempt)
    else:
        stmt = stmt.order_by(*live_first()).limit(1)
    row = conn.execute(stmt.with_for_update(of=checkpoints) if lock else stmt).one_or_none()
    if row is None:
        run_row(conn, run)
        which = f" by attempt {attempt!r}" if attempt else ""
        raise NotFound(f"run {run!r} has no checkpoint at step {step}{which}")
    return row


def checkpoint_row_by_id(conn: Connection, checkpoint_id: int, *, lock: bool = False) -> Row:
    stmt = checkpoint_select().where(checkpoints.c.id == checkpoint_id)
    row = conn.execute(stmt.with_for_update(of=checkpoints) if lock else stmt).one_or_none()
    if row is None:
        raise NotFound(f"no checkpoint with id {checkpoint_id}")
    return row


def replica_row(conn: Connection, replica_id: int, *, lock: bool = False) -> Row:
    stmt = replica_select().where(replicas.c.id == replica_id)
    row = conn.execute(stmt.with_for_update(of=replicas) if lock else stmt).one_or_none()
    if row is None:
        raise NotFound(f"no replica with id {replica_id}")
    return row


# --- conversions -----------------------------------------------------------------------
def to_run(row: Row) -> RunInfo:
    return RunInfo(id=row.id, name=row.name, project=row.project, created_at=row.created_at,
                   config_digest=row.config_digest, code_digest=row.code_digest,
                   tags=dict(row.tags or {}), parent_run=row.parent_run,
                   parent_step=row.parent_step, parent_relation=row.parent_relation)


def to_checkpoint(row: Row | SimpleNamespace) -> CheckpointInfo:  # or the values just inserted
    return CheckpointInfo(
        id=row.id, run=row.run_name, step=row.step, kind=row.kind, state=row.state,
        parts=row.parts, parts_registered=row.parts_registered, total_bytes=row.total_bytes,
        file_count=row.file_count, metrics=dict(row.metrics or {}), created_at=row.created_at,
        committed_at=row.committed_at, writer_stall_seconds=row.writer_stall_seconds,
        format=row.format, tags=dict(row.tags or {}), attempt=getattr(row, "attempt", "") or "",
        superseded_by=getattr(row, "superseded_by", None),
    )


def to_replica(row: Row) -> ReplicaInfo:
    return ReplicaInfo(
        id=row.id, checkpoint_id=row.checkpoint_id, run=row.run_name, step=row.step,
        tier=row.tier, part=row.part, node=row.node, url=row.url, state=row.state,
        bytes=row.bytes, verified_at=row.verified_at, copy_seconds=row.copy_seconds,
        etag=row.etag, version_id=row.version_id, claim_token=row.claim_token,
        updated_at=row.updated_at, checked_at=row.checked_at, attempt=getattr(row, "attempt", "") or "",
    )


def to_file(row: Row) -> FileInfo:
    return FileInfo(checkpoint_id=row.checkpoint_id, part=row.part, path=row.path, size=row.size,
                    algorithm=row.algorithm, checksum=row.checksum)


def to_audit(row: Row) -> AuditEntry:
    return AuditEntry(id=row.id, at=row.at, actor=row.actor, subject=row.subject, action=row.action,
                      from_state=row.from_state, to_state=row.to_state, reason=row.reason,
                      run=row.run, step=row.step)


def to_drill(row: Row) -> DrillResult:
    return DrillResult(id=row.id, run=row.run_name, step=row.step, tier=row.tier, ok=row.ok,
                       seconds=row.seconds, bytes=row.bytes, at=row.at, detail=row.detail, nodes=row.nodes,
                       bound_seconds=row.bound_seconds, tier_bytes=row.tier_bytes, node_seconds=row.node_seconds)


def insert_ignore(conn: Connection, table: Table, values: dict[str, Any], keys: list[str]) -> int:
    """INSERT ... ON CONFLICT (keys) DO NOTHING; returns 1 if this call inserted the row.

    On PostgreSQL a concurrent insert of the same key waits for the other transaction, so
    exactly one caller sees 1."""
    return 0 if insert_new(conn, table, values, keys, keys[0]) is None else 1


def insert_new(conn: Connection, table: Table, values: dict[str, Any], keys: list[str], returning: str) -> Any:
    """INSERT ... ON CONFLICT (keys) DO NOTHING RETURNING ``returning``: the value, or None if
    the row already existed. (RETURNING, not rowcount: psycopg reports -1 with RETURNING.)"""
    stmt = _insert_ignore_stmt(conn.dialect.name, table.name, tuple(keys), returning)
    return conn.execute(stmt, values).scalar()


@cache
def _insert_ignore_stmt(dialect: str, table_name: str, keys: tuple[str, ...], returning: str) -> Executable:
    """Built once per shape: SQLAlchemy then reuses the compiled statement (registration speed)."""
    from sqlalchemy.dialects import postgresql, sqlite

    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    table = Base.metadata.tables[table_name]
    return insert(table).on_conflict_do_nothing(index_elements=list(keys)).returning(table.c[returning])


def add_audit(conn: Connection, *, at: datetime, actor: str, subject: str, action: str, from_state: str | None = None,
              to_state: str | None = None, reason: str | None = None, run: str | None = None,
              step: int | None = None) -> None:
    conn.execute(audit.insert(), dict(at=at, actor=actor, subject=subject, action=action, from_state=from_state,
                                      to_state=to_state, reason=reason, run=run, step=step))
