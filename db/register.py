"""Recording runs and checkpoint parts (inside the caller's transaction).

Registration is idempotent on the manifest's digest: the same part again is a no-op, a
different manifest for a recorded (run, step, part) is a ``ConflictError``, never an overwrite.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.engine import Connection, Row

from ckpt.errors import ConflictError
from ckpt.manifest import Manifest
from ckpt.paths import safe_run_name
from db.entities import CKPT_COMMITTED, CKPT_PARTIAL
from db.lineage import add_edge, check_relation, link_into_run
from db.rows import add_audit, checkpoint_row, checkpoints, files, insert_ignore, parts, run_row, runs

_KIND_RANK = {"step": 0, "epoch": 1, "milestone": 2}


def ensure_run(conn: Connection, name: str, *, now: datetime, actor: str, parent: tuple[str, int] | None,
               parent_relation: str, **fields) -> Row:
    safe_run_name(name)
    check_relation(parent_relation)
    if parent is not None:
        checkpoint_row(conn, parent[0], parent[1])  # the origin must be recorded: NotFound otherwise
    values = dict(name=name, created_at=now, tags=fields.pop("tags") or {}, **fields)
    if parent is not None:
        values.update(parent_run=parent[0], parent_step=parent[1], parent_relation=parent_relation)
    if insert_ignore(conn, runs, values, ["name"]):
        add_audit(conn, at=now, actor=actor, subject=f"run:{name}", action="create-run",
                  reason=f"{parent_relation} {parent[0]}/{parent[1]}" if parent else None, run=name)
        return run_row(conn, name)
    run = run_row(conn, name, lock=True)
    if parent is not None and run.parent_run is None:
        _adopt_origin(conn, run, parent, parent_relation, now=now, actor=actor)
        run = run_row(conn, name)
    return run


def _adopt_origin(conn: Connection, run: Row, parent: tuple[str, int], relation: str, *, now: datetime,
                  actor: str) -> None:
    """A run recorded without an origin learns it later: store it and link its first checkpoint."""
    conn.execute(update(runs).where(runs.c.id == run.id).values(
        parent_run=parent[0], parent_step=parent[1], parent_relation=relation))
    first = conn.execute(select(checkpoints.c.id).where(checkpoints.c.run_id == run.id)
                         .order_by(checkpoints.c.step).limit(1)).scalar()
    if first is not None:
        add_edge(conn, first, checkpoint_row(conn, *parent).id, relation, now=now)
    add_audit(conn, at=now, actor=actor, subject=f"run:{run.name}", action="set-origin",
              reason=f"{relation} {parent[0]}/{parent[1]}", run=run.name)


def register_part(conn: Connection, m: Manifest, *, digest: str, now: datetime, actor: str) -> int:
    """Record one part; returns the checkpoint id."""
    run = run_row(conn, m.run)
    created = insert_ignore(conn, checkpoints, dict(
        run_id=run.id, step=m.step, kind=m.kind, state=CKPT_PARTIAL, format=m.format, parts=m.parts,
        parts_registered=0, total_bytes=0, file_count=0, metrics=dict(m.metrics), tags=dict(m.tags),
        created_at=_parse_time(m.created_at) or now, committed_at=None,
        writer_stall_seconds=m.writer_stall_seconds, verified_tiers=0), ["run_id", "step"]) == 1
    ck = checkpoint_row(conn, m.run, m.step, lock=True)
    where = f"checkpoint {m.run}/{m.step}"
    if ck.parts != m.parts:
        raise ConflictError(f"{where} has {ck.parts} part(s); this manifest says {m.parts}")
    recorded = conn.execute(select(parts.c.manifest_digest)
                            .where(parts.c.checkpoint_id == ck.id, parts.c.part == m.part)).scalar()
    if recorded is not None:
        if recorded == digest:
            return ck.id
        raise ConflictError(f"{where} part {m.part} is already registered with a different manifest "
                            f"(digest {recorded[:12]}, this one {digest[:12]}); refusing to overwrite it")
    conn.execute(parts.insert().values(checkpoint_id=ck.id, part=m.part, node=m.node or None,
                                       manifest_digest=digest, bytes=m.total_bytes,
                                       file_count=len(m.files), registered_at=now))
    if m.files:
        conn.execute(files.insert(), [dict(checkpoint_id=ck.id, part=m.part, path=f.path, size=f.size,
                                           algorithm=m.algorithm, checksum=f.checksum) for f in m.files])
    _merge_part(conn, ck, m, now=now, actor=actor)
    if created:
        link_into_run(conn, run=run, checkpoint_id=ck.id, step=m.step, now=now)
    if m.parent is not None:
        parent = checkpoint_row(conn, m.parent.run, m.parent.step)
        add_edge(conn, ck.id, parent.id, m.parent.relation, now=now, check_cycle=not created)
    return ck.id


def _merge_part(conn: Connection, ck: Row, m: Manifest, *, now: datetime, actor: str) -> None:
    registered = ck.parts_registered + 1
    state = CKPT_COMMITTED if ck.state == CKPT_PARTIAL and registered == ck.parts else ck.state
    stalls = [s for s in (ck.writer_stall_seconds, m.writer_stall_seconds) if s is not None]
    conn.execute(update(checkpoints).where(checkpoints.c.id == ck.id).values(
        parts_registered=registered, state=state,
        committed_at=now if state == CKPT_COMMITTED and ck.state != CKPT_COMMITTED else ck.committed_at,
        total_bytes=ck.total_bytes + m.total_bytes, file_count=ck.file_count + len(m.files),
        kind=max(ck.kind, m.kind, key=lambda k: _KIND_RANK.get(k, 0)),
        metrics={**(ck.metrics or {}), **m.metrics}, tags={**(ck.tags or {}), **m.tags},
        writer_stall_seconds=max(stalls) if stalls else None))
    add_audit(conn, at=now, actor=actor, subject=f"checkpoint:{m.run}/{m.step}", action="register",
              from_state=ck.state if ck.parts_registered else None, to_state=state,
              reason=f"part {m.part} of {m.parts}" + (f" from {m.node}" if m.node else ""),
              run=m.run, step=m.step)


def _parse_time(text: str) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None
