"""Recording runs and checkpoint parts (inside the caller's transaction).

Registration is idempotent on the manifest's digest: the same part again is a no-op, a
different manifest for a recorded (run, step, part) is a ``ConflictError``, never an overwrite.
The parts of one checkpoint never hold different bytes at one relative path
(``_refuse_colliding_paths``).

A run's origin (the checkpoint it was resumed, fine-tuned or branched from) is kept on its run
row, from ``ensure_run(parent=...)`` or from the first manifest registered whose ``parent`` is in
another run; the run's first checkpoint gets the lineage edge to it. An origin the catalog does
not know yet is *pending*: the run and its checkpoints are registered as ever, and the edge is
added when the origin checkpoint is registered (``_LINK_WAITING``). A retired origin is recorded
all the same (the edge is history; restore and resume only offer committed checkpoints), with a
warning and an ``origin-retired`` audit row.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from sqlalchemy import Table, and_, bindparam, exists, func, select, update
from sqlalchemy.engine import Connection, Row

from core.errors import CollidingPaths, ConflictError
from core.layout import check_ref
from core.manifest import Manifest
from core.paths import safe_run_name
from core.policy import milestone_marks
from db.attempts import attempt_row, attempts, standing
from db.entities import CKPT_COMMITTED, CKPT_PARTIAL, CKPT_REJECTED, CKPT_RETIRED, CKPT_SUPERSEDED, CheckpointInfo
from db.lineage import FOLLOWS, add_edge, check_relation, link_into_run, origin_id
from db.models import encode_metrics
from db.rows import (
    add_audit,
    audit,
    checkpoint_row,
    checkpoint_row_by_id,
    checkpoints,
    files,
    insert_ignore,
    insert_new,
    lineage,
    parts,
    run_row,
    runs,
    to_checkpoint,
)

log = logging.getLogger(__name__)

_KIND_RANK = {"step": 0, "epoch": 1, "milestone": 2}


def ensure_run(conn: Connection, name: str, *, now: datetime, actor: str, parent: tuple[str, int] | None,
               parent_relation: str, **fields: Any) -> Row:
    """Create the run or return it; a run recorded without an origin learns ``parent`` (one
    recorded already is kept). The origin need not be registered yet (it is then pending)."""
    safe_run_name(name)
    check_relation(parent_relation)
    if parent is not None:
        safe_run_name(parent[0])
        check_ref(parent[1])
    values = dict(name=name, created_at=now, tags=fields.pop("tags") or {}, **fields)
    if parent is not None:
        values.update(parent_run=parent[0], parent_step=parent[1], parent_relation=parent_relation)
    if insert_ignore(conn, runs, values, ["name"]):
        note = _origin_note(conn, f"run {name} is", parent, parent_relation, now=now, actor=actor,
                            run=name) if parent else ""
        add_audit(conn, at=now, actor=actor, subject=f"run:{name}", action="create-run",
                  reason=f"{parent_relation} {parent[0]}/{parent[1]}{note}" if parent else None, run=name)
        return run_row(conn, name)
    run = run_row(conn, name, lock=True)
    if parent is not None and run.parent_run is None:
        _adopt_origin(conn, run, parent, parent_relation, now=now, actor=actor)
        run = run_row(conn, name)
    return run


def _adopt_origin(conn: Connection, run: Row, parent: tuple[str, int], relation: str, *, now: datetime,
                  actor: str) -> None:
    """A run recorded without an origin learns it later: store it and link its first checkpoint
    (when the origin is registered; else the edge waits for it)."""
    conn.execute(update(runs).where(runs.c.id == run.id).values(
        parent_run=parent[0], parent_step=parent[1], parent_relation=relation))
    note = _origin_note(conn, f"run {run.name} is", parent, relation, now=now, actor=actor, run=run.name)
    origin = _checkpoint_id(conn, *parent)
    first = conn.execute(select(checkpoints.c.id).where(checkpoints.c.run_id == run.id)
                         .order_by(checkpoints.c.step).limit(1)).scalar()
    if first is not None and origin is not None:
        add_edge(conn, first, origin, relation, now=now)
    add_audit(conn, at=now, actor=actor, subject=f"run:{run.name}", action="set-origin",
              reason=f"{relation} {parent[0]}/{parent[1]}{note}", run=run.name)


def _origin_note(conn: Connection, who: str, parent: tuple[str, int], relation: str, *, now: datetime,
                 actor: str, run: str) -> str:
    """What recording ``parent`` as where ``who`` comes from adds to its audit reason: a pending
    origin is said so; a retired one is warned about and audited (``origin-retired``)."""
    state = conn.execute(select(checkpoints.c.state).join(runs, runs.c.id == checkpoints.c.run_id)
                         .where(runs.c.name == parent[0], checkpoints.c.step == parent[1])).scalar()
    if state is None:
        log.info("%s %s %s/%d, not in the catalog yet: linked when it is registered", who, relation, *parent)
        return " (pending: not registered yet)"
    if state == CKPT_RETIRED:
        why = (f"{who} {relation} {parent[0]}/{parent[1]}, which is RETIRED: the edge is recorded as "
               f"history; that checkpoint is no resume or restore source")
        log.warning("%s", why)
        add_audit(conn, at=now, actor=actor, subject=f"run:{run}", action="origin-retired", reason=why, run=run)
        return " (retired)"
    return ""


def _checkpoint_id(conn: Connection, run: str, step: int) -> int | None:
    return conn.execute(select(checkpoints.c.id).join(runs, runs.c.id == checkpoints.c.run_id)
                        .where(runs.c.name == run, checkpoints.c.step == step)).scalar()


def _learn_origin(conn: Connection, run: Row, m: Manifest, *, now: datetime, actor: str) -> Row:
    """The run's row, with the manifest's parent as its origin if the run has none yet and the
    parent is in another run: a catalog rebuilt from manifests alone gets every run's origin."""
    p = m.parent
    if p is None or p.run == m.run or run.parent_run is not None:
        return run
    _adopt_origin(conn, run, (p.run, p.step), p.relation, now=now, actor=actor)
    return run_row(conn, m.run)


def register_part(conn: Connection, m: Manifest, *, digest: str, now: datetime | None, actor: str) -> CheckpointInfo:
    """Record one part; returns the checkpoint as it now stands. The run row is locked so that
    two checkpoints of one run registered at once still form one ``follows`` chain. ``now``
    None (PostgreSQL): the server's clock, read with that lock in the same round trip.

    The common case, a new checkpoint: the run (locked; on PostgreSQL with the clock, one round
    trip less), the checkpoint, its part, its files, its audit row, its place in the run's
    lineage: on PostgreSQL two statements in all (``_NEW_CHECKPOINT_PG``), on SQLite one per
    table (``_insert_new_each``)."""
    run = run_row(conn, m.run, lock=True, with_clock=now is None)
    if now is None:
        now = run.catalog_now.astimezone(UTC)
    run = _learn_origin(conn, run, m, now=now, actor=actor)
    first = _first_part_values(run.id, m, now)
    new = _insert_new_pg if conn.dialect.name == "postgresql" else _insert_new_each
    cid = new(conn, run, first, m, digest=digest, now=now, actor=actor)
    if cid is None and _unknown(conn, run.id, m):  # PostgreSQL's one statement holds back for the attempt rules
        by = standing(conn, run, m.attempt, m.step, created=m.created_at, now=now, actor=actor)
        if by is not None:  # a late part of an older attempt: history, never joined to the newer one's
            first.update(state=CKPT_SUPERSEDED, superseded_by=by, superseded_at=now, committed_at=None)
        cid = _insert_new_each(conn, run, first, m, digest=digest, now=now, actor=actor, ruled=True)
    if cid is not None:  # the common case, a new checkpoint: no read-back needed
        _link_parent(conn, cid, m, run, now=now, actor=actor)
        return to_checkpoint(SimpleNamespace(**first, id=cid, run_name=m.run))
    ck = checkpoint_row(conn, m.run, m.step, attempt=m.attempt, lock=True)
    where = f"checkpoint {m.run}/{m.step}" + (f" of attempt {m.attempt}" if m.attempt else "")
    if ck.parts != m.parts:
        raise ConflictError(f"{where} has {ck.parts} part(s); this manifest says {m.parts}")
    recorded = conn.execute(select(parts.c.manifest_digest)
                            .where(parts.c.checkpoint_id == ck.id, parts.c.part == m.part)).scalar()
    if recorded is None:
        _refuse_colliding_paths(conn, ck.id, m)
        _add_part(conn, ck.id, m, digest=digest, now=now)
        _merge_part(conn, ck, m, now=now, actor=actor)
        _link_parent(conn, ck.id, m, run, now=now, actor=actor)
    elif recorded != digest:
        raise ConflictError(f"{where} part {m.part} is already registered with a different manifest "
                            f"(digest {recorded[:12]}, this one {digest[:12]}); refusing to overwrite it")
    return to_checkpoint(checkpoint_row_by_id(conn, ck.id))


_PATHS_PER_QUERY = 500  # bound parameters per query: far below every backend's limit


def _refuse_colliding_paths(conn: Connection, cid: int, m: Manifest) -> None:
    """``ConflictError`` when a file of part ``m.part`` has the relative path of a file another
    registered part of the checkpoint lists with other bytes (size, checksum or its algorithm). All parts sit
    side by side in one folder on Tier 1 and 2: the second would be refused there, and the
    checkpoint could never be whole. The ranks of a job cannot see each other's file names, so
    this is the first place that can tell. The same bytes at one path in several parts (a
    ``config.json`` every node writes) are one file there, kept while any part lists it
    (``tasks.base.shared_paths``)."""
    mine = {f.path: (f.size, f.checksum) for f in m.files}
    paths = sorted(mine)
    for i in range(0, len(paths), _PATHS_PER_QUERY):
        rows = conn.execute(select(files.c.part, files.c.path, files.c.size, files.c.algorithm, files.c.checksum)
                            .where(files.c.checkpoint_id == cid, files.c.part != m.part,
                                   files.c.path.in_(paths[i:i + _PATHS_PER_QUERY]))
                            .order_by(files.c.path, files.c.part))
        for r in rows:
            if (r.size, r.checksum) != mine[r.path] or r.algorithm != m.algorithm:
                raise CollidingPaths(f"checkpoint {m.run}/{m.step} part {m.part} of {m.parts}: its file {r.path!r} "
                                    f"is also a file of part {r.part}, with other bytes; the parts of a checkpoint "
                                    f"must write different relative paths (e.g. under part-{m.part:05d}/)")


# A new checkpoint on PostgreSQL in one statement, whatever its file count: the attempt's row
# (``db.attempts``: first heard of now, if new), the checkpoint row (nothing if the (run, step,
# attempt) exists, or when another attempt holds the step or a newer attempt resumed from below
# it, or when this attempt never resumed and the run has other attempts: then nothing else is
# written either, and ``register_part`` applies the attempt rules), its part, its files
# (arrays, so the text never changes and psycopg prepares it once per connection), its audit
# row, its ``follows`` edge to the run's previous checkpoint and the edges of the runs that wait
# for it as their origin (``_LINK_WAITING``: pending origins). It returns the new id and the
# run's previous and next checkpoints; the rare rest (a run's first checkpoint linked to its
# origin, one registered out of order spliced in) is ``link_into_run``'s, as before.
_NEW_CHECKPOINT_PG = """
WITH me AS (
    SELECT id FROM attempts WHERE run_id = %(run_id)s AND attempt = %(attempt)s
), att AS (
    INSERT INTO attempts (run_id, attempt, resumed_from_step, started_at)
    VALUES (%(run_id)s, %(attempt)s, NULL, %(now)s) ON CONFLICT (run_id, attempt) DO NOTHING
), ck AS (
    INSERT INTO checkpoints (run_id, step, kind, state, format, parts, parts_registered, total_bytes, file_count,
                             metrics, tags, created_at, committed_at, writer_stall_seconds, verified_tiers,
                             milestone_marks, attempt)
    SELECT %(run_id)s, %(step)s, %(kind)s, %(state)s, %(format)s, %(parts)s, %(parts_registered)s,
           %(total_bytes)s, %(file_count)s, %(metrics)s::json, %(tags)s::json, %(created_at)s, %(committed_at)s,
           %(writer_stall_seconds)s, %(verified_tiers)s, %(milestone_marks)s, %(attempt)s
    WHERE NOT EXISTS (SELECT 1 FROM checkpoints WHERE run_id = %(run_id)s AND step = %(step)s
                      AND attempt <> %(attempt)s AND state NOT IN ('superseded', 'retired'))
      AND NOT EXISTS (SELECT 1 FROM attempts WHERE run_id = %(run_id)s AND resumed_from_step < %(step)s
                      AND id > COALESCE((SELECT id FROM me), 9223372036854775807))
      AND (EXISTS (SELECT 1 FROM attempts WHERE run_id = %(run_id)s AND attempt = %(attempt)s
                   AND resumed_from_step IS NOT NULL)
           OR NOT EXISTS (SELECT 1 FROM attempts WHERE run_id = %(run_id)s AND attempt <> %(attempt)s))
    ON CONFLICT (run_id, step, attempt) DO NOTHING
    RETURNING id
), nb AS (
    SELECT (SELECT id FROM checkpoints WHERE run_id = %(run_id)s AND step < %(step)s AND superseded_at IS NULL
            ORDER BY step DESC LIMIT 1) AS prev,
           (SELECT id FROM checkpoints WHERE run_id = %(run_id)s AND step > %(step)s AND superseded_at IS NULL
            ORDER BY step LIMIT 1) AS nxt
), part AS (
    INSERT INTO checkpoint_parts (checkpoint_id, part, node, manifest_digest, bytes, file_count, registered_at)
    SELECT id, %(part)s, %(node)s, %(digest)s, %(total_bytes)s, %(file_count)s, %(now)s FROM ck
), file AS (
    INSERT INTO checkpoint_files (checkpoint_id, part, path, size, algorithm, checksum)
    SELECT ck.id, %(part)s, f.path, f.size, %(algorithm)s, f.checksum
    FROM ck, unnest(%(paths)s::text[], %(sizes)s::bigint[], %(checksums)s::text[]) AS f(path, size, checksum)
), audit AS (
    INSERT INTO audit_log (at, actor, subject, action, from_state, to_state, reason, run, step)
    SELECT %(now)s, %(actor)s, %(subject)s, %(action)s, NULL, %(state)s, %(reason)s, %(run)s, %(step)s FROM ck
), edge AS (
    INSERT INTO lineage (child_id, parent_id, relation, created_at)
    SELECT ck.id, nb.prev, 'follows', %(now)s FROM ck, nb WHERE nb.prev IS NOT NULL
), waiting AS (
    INSERT INTO lineage (child_id, parent_id, relation, created_at)
    SELECT f.id, ck.id, COALESCE(r.parent_relation, 'resumed_from'), %(now)s
    FROM ck, runs r, LATERAL (SELECT c.id FROM checkpoints c WHERE c.run_id = r.id ORDER BY c.step, c.id LIMIT 1) f
    WHERE r.parent_run = %(run)s AND r.parent_step = %(step)s AND r.id <> %(run_id)s
)
SELECT ck.id, nb.prev, nb.nxt FROM ck, nb
"""


def _unknown(conn: Connection, run_id: int, m: Manifest) -> bool:
    return conn.execute(select(checkpoints.c.id).where(
        checkpoints.c.run_id == run_id, checkpoints.c.step == m.step,
        checkpoints.c.attempt == m.attempt)).first() is None


def _insert_new_each(conn: Connection, run: Row, first: dict[str, Any], m: Manifest, *, digest: str, now: datetime,
                     actor: str, ruled: bool = False) -> int | None:
    """A new checkpoint a statement per table (SQLite, where a statement is no round trip): its
    id, or None if (run, step, attempt) is recorded. ``ruled``: the attempt rules were applied
    (``db.attempts.standing``) and ``first`` says their verdict."""
    if not ruled and _unknown(conn, run.id, m):
        by = standing(conn, run, m.attempt, m.step, created=m.created_at, now=now, actor=actor)
        if by is not None:
            first.update(state=CKPT_SUPERSEDED, superseded_by=by, superseded_at=now, committed_at=None)
    cid = insert_new(conn, checkpoints, first, ["run_id", "step", "attempt"], "id")
    if cid is not None:
        _add_part(conn, cid, m, digest=digest, now=now)
        _audit_register(conn, m, None, first["state"], now=now, actor=actor)
        if first["state"] != CKPT_SUPERSEDED:  # a superseded one stays off the run's live chain
            link_into_run(conn, run=run, checkpoint_id=cid, step=m.step, now=now)
        link_waiting_runs(conn, [cid], now=now)
    return cid


def _insert_new_pg(conn: Connection, run: Row, first: dict[str, Any], m: Manifest, *, digest: str, now: datetime,
                   actor: str) -> int | None:
    """``_NEW_CHECKPOINT_PG``: the new checkpoint's id, or None if (run, step) is recorded."""
    note = _register_audit(m, None, first["state"], now, actor)
    row = conn.exec_driver_sql(_NEW_CHECKPOINT_PG, dict(
        first, metrics=json.dumps(encode_metrics(first["metrics"])), tags=json.dumps(first["tags"]), part=m.part,
        node=m.node or None, digest=digest, now=now, algorithm=m.algorithm, paths=[f.path for f in m.files],
        sizes=[f.size for f in m.files], checksums=[f.checksum for f in m.files], actor=actor,
        subject=note["subject"], action=note["action"], reason=note["reason"], run=m.run)).one_or_none()
    if row is None:
        return None
    cid, prev, nxt = row
    if prev is None or nxt is not None:  # a run's first checkpoint, or one registered out of order
        link_into_run(conn, run=run, checkpoint_id=cid, step=m.step, now=now)
    return cid


def register_batch(conn: Connection, manifests: list[Manifest], *, now: datetime, actor: str) -> None:
    """Many manifests in one transaction. New checkpoints appended after their run's newest
    (a backfill, an import) go in with one multi-row INSERT per table; anything else (a known
    (run, step), several parts of one checkpoint, a step older than the run's newest) goes
    through ``register_part`` one by one, so the rules are the same either way."""
    fast, slow = _split_batch(conn, manifests, now=now, actor=actor)
    for run_id in {run.id for run, _ in fast}:  # the unnamed attempt's row, as a first part records it
        attempt_row(conn, run_id, "", now=now)
    for m in slow:
        register_part(conn, m, digest=m.digest(), now=now, actor=actor)
    if not fast:
        return
    rows = [_first_part_values(run.id, m, now) for run, m in fast]
    ids = _insert_checkpoints(conn, rows)
    _bulk(conn, parts, [_part_values(cid, m, m.digest(), now) for cid, (_, m) in zip(ids, fast, strict=True)])
    _bulk(conn, files, [f for cid, (_, m) in zip(ids, fast, strict=True) for f in _file_values(cid, m)])
    _bulk(conn, audit, [_register_audit(m, None, r["state"], now, actor) for r, (_, m) in zip(rows, fast, strict=True)])
    edges: list[dict[str, Any]] = []
    last: dict[int, int] = {}  # run id -> its newest checkpoint id in this batch
    for cid, (run, m) in zip(ids, fast, strict=True):
        parent, relation = last.get(run.id) or _newest_id(conn, run.id, below=m.step), FOLLOWS
        if parent is None:  # the run's first checkpoint: it comes from the run's origin, if any
            parent, relation = origin_id(conn, run), run.parent_relation
        if parent is not None:
            edges.append(dict(child_id=cid, parent_id=parent, relation=relation, created_at=now))
        last[run.id] = cid
        _link_parent(conn, cid, m, run, now=now, actor=actor)
    if edges:
        _bulk(conn, lineage, edges)
    link_waiting_runs(conn, ids, now=now)


def link_waiting_runs(conn: Connection, checkpoint_ids: Sequence[int], *, now: datetime) -> None:
    """Complete the pending origins that ``checkpoint_ids`` (new checkpoints) are: the first
    checkpoint of each run recorded as resumed/fine-tuned/branched from one of them gets its
    edge. No cycle check: a checkpoint registered just now has no ancestor but its own run's."""
    for i in range(0, len(checkpoint_ids), _CHUNK):
        conn.execute(_LINK_WAITING, {"ids": list(checkpoint_ids[i:i + _CHUNK]), "now": now})


def _link_waiting():
    origin, origin_run, child = checkpoints.alias("origin"), runs.alias("origin_run"), runs.alias("child_run")
    first = (select(checkpoints.c.id).where(checkpoints.c.run_id == child.c.id)
             .order_by(checkpoints.c.step, checkpoints.c.id).limit(1).correlate(child).scalar_subquery())
    linked = exists().where(lineage.c.child_id == first, lineage.c.parent_id == origin.c.id)
    relation = func.coalesce(child.c.parent_relation, "resumed_from")  # as ``link_into_run`` reads it
    rows = (select(first, origin.c.id, relation, bindparam("now"))
            .select_from(origin.join(origin_run, origin_run.c.id == origin.c.run_id)
                         .join(child, and_(child.c.parent_run == origin_run.c.name,
                                           child.c.parent_step == origin.c.step, child.c.id != origin_run.c.id)))
            .where(origin.c.id.in_(bindparam("ids", expanding=True)), first.is_not(None), ~linked))
    return lineage.insert().from_select(["child_id", "parent_id", "relation", "created_at"], rows)


_LINK_WAITING = _link_waiting()  # (ids, now): the edges of the runs whose pending origin is one of ids
_CHUNK = 500


def _insert_checkpoints(conn: Connection, rows: list[dict]) -> list[int]:
    """Insert checkpoint rows, returning their ids in row order."""
    if conn.dialect.name != "postgresql":
        return [r.id for r in conn.execute(
            checkpoints.insert().returning(checkpoints.c.id, sort_by_parameter_order=True), rows)]
    ids = list(conn.exec_driver_sql(
        "SELECT nextval(pg_get_serial_sequence('checkpoints', 'id')) FROM generate_series(1, %(n)s)",
        {"n": len(rows)}).scalars())
    # COPY bypasses the column's type: its metrics encoded here, as ``Metrics`` does for a statement
    _bulk(conn, checkpoints,
          [dict(r, id=i, metrics=encode_metrics(r["metrics"])) for r, i in zip(rows, ids, strict=True)])
    return ids


def _bulk(conn: Connection, table: Table, rows: list[dict[str, Any]]) -> None:
    """Multi-row INSERT inside the current transaction: executemany on SQLite, COPY on
    PostgreSQL (psycopg's executemany sends one INSERT per row, and SQLAlchemy's multi-row
    VALUES spends its time in psycopg's query parser: COPY measured several times faster)."""
    if not rows:
        return
    if conn.dialect.name != "postgresql":
        conn.execute(table.insert(), rows)
        return
    cols = list(rows[0])
    driver: Any = conn.connection.dbapi_connection  # psycopg's connection: COPY is psycopg's
    cursor = driver.cursor()
    with cursor.copy(f"COPY {table.name} ({', '.join(cols)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row([_copy_value(row[c]) for c in cols])


def _copy_value(v):
    if isinstance(v, dict):
        return json.dumps(v)
    if isinstance(v, datetime):
        return v.astimezone(UTC)
    return v


def _split_batch(conn: Connection, manifests: list[Manifest], *, now: datetime,
                 actor: str) -> tuple[list[tuple[Row, Manifest]], list[Manifest]]:
    """(fast: [(run, manifest)] in run/step order, slow: [manifest]) -- see ``register_batch``.
    Each run learns its origin from its manifests here (``_learn_origin``)."""
    by_run: dict[str, list[Manifest]] = {}
    for m in manifests:
        by_run.setdefault(m.run, []).append(m)
    fast: list[tuple[Row, Manifest]] = []
    slow: list[Manifest] = []
    for name, ms in by_run.items():
        run = run_row(conn, name, lock=True)
        for m in ms:
            run = _learn_origin(conn, run, m, now=now, actor=actor)
        steps = [m.step for m in ms]
        newest = conn.execute(select(func.max(checkpoints.c.step)).where(checkpoints.c.run_id == run.id)).scalar()
        plain = all(not m.attempt for m in ms) and not _named_attempts(conn, run.id)  # else register_part's rules
        if plain and len(set(steps)) == len(steps) and (newest is None or min(steps) > newest):
            fast += [(run, m) for m in sorted(ms, key=lambda m: m.step)]
        else:
            slow += ms
    return fast, slow


def _named_attempts(conn: Connection, run_id: int) -> bool:
    return conn.execute(select(attempts.c.id).where(attempts.c.run_id == run_id, attempts.c.attempt != "")
                        .limit(1)).first() is not None


def _newest_id(conn: Connection, run_id: int, *, below: int) -> int | None:
    return conn.execute(select(checkpoints.c.id).where(checkpoints.c.run_id == run_id, checkpoints.c.step < below)
                        .order_by(checkpoints.c.step.desc()).limit(1)).scalar()


def _first_part_values(run_id: int, m: Manifest, now: datetime) -> dict:
    """The checkpoint row as the first registered part makes it."""
    state = CKPT_COMMITTED if m.parts == 1 else CKPT_PARTIAL
    return dict(run_id=run_id, step=m.step, kind=m.kind, state=state, format=m.format, parts=m.parts,
                parts_registered=1, total_bytes=m.total_bytes, file_count=len(m.files), metrics=dict(m.metrics),
                tags=dict(m.tags), created_at=_parse_time(m.created_at) or now,
                committed_at=now if state == CKPT_COMMITTED else None,
                writer_stall_seconds=m.writer_stall_seconds, verified_tiers=0,
                milestone_marks=milestone_marks(m.kind, m.tags), attempt=m.attempt)


def _part_values(cid: int, m: Manifest, digest: str, now: datetime) -> dict:
    return dict(checkpoint_id=cid, part=m.part, node=m.node or None, manifest_digest=digest,
                bytes=m.total_bytes, file_count=len(m.files), registered_at=now)


def _file_values(cid: int, m: Manifest) -> list[dict]:
    return [dict(checkpoint_id=cid, part=m.part, path=f.path, size=f.size, algorithm=m.algorithm,
                 checksum=f.checksum) for f in m.files]


def _add_part(conn: Connection, cid: int, m: Manifest, *, digest: str, now: datetime) -> None:
    conn.execute(parts.insert(), _part_values(cid, m, digest, now))
    if m.files:  # executemany: one cached statement, pipelined by psycopg (a multi-row VALUES compiles per call)
        conn.execute(files.insert(), _file_values(cid, m))


def _link_parent(conn: Connection, cid: int, m: Manifest, run: Row, *, now: datetime, actor: str) -> None:
    """The manifest's own parent edge, unless that parent is the run's origin (the run's first
    checkpoint carries that edge: ``link_into_run``, ``link_waiting_runs``). A parent the catalog
    does not know is warned about and audited, and the part is registered without the edge: a
    good checkpoint is never held back for its history."""
    p = m.parent
    if p is None or (p.run, p.step) == (run.parent_run, run.parent_step):
        return
    who = f"checkpoint {m.run}/{m.step} is"
    pid = _checkpoint_id(conn, p.run, p.step)
    if pid is None:
        why = f"{who} {p.relation} {p.run}/{p.step}, which is not in the catalog: registered without that edge"
        log.warning("%s", why)
        add_audit(conn, at=now, actor=actor, subject=f"checkpoint:{m.run}/{m.step}", action="parent-unknown",
                  reason=why, run=m.run, step=m.step)
        return
    _origin_note(conn, who, (p.run, p.step), p.relation, now=now, actor=actor, run=m.run)
    add_edge(conn, cid, pid, p.relation, now=now)


def _register_audit(m: Manifest, from_state: str | None, to_state: str, now: datetime, actor: str) -> dict:
    return dict(at=now, actor=actor, subject=f"checkpoint:{m.run}/{m.step}", action="register",
                from_state=from_state, to_state=to_state, run=m.run, step=m.step,
                reason=f"part {m.part} of {m.parts}" + (f" from {m.node}" if m.node else ""))


def _audit_register(conn: Connection, m: Manifest, from_state: str | None, to_state: str, *, now: datetime,
                    actor: str) -> None:
    conn.execute(audit.insert(), _register_audit(m, from_state, to_state, now, actor))


def _merge_part(conn: Connection, ck: Row, m: Manifest, *, now: datetime, actor: str) -> None:
    registered = ck.parts_registered + 1
    before = CKPT_PARTIAL if ck.state == CKPT_REJECTED else ck.state  # the refused part came after all
    state = CKPT_COMMITTED if before == CKPT_PARTIAL and registered == ck.parts else before
    stalls = [s for s in (ck.writer_stall_seconds, m.writer_stall_seconds) if s is not None]
    kind, tags = max(ck.kind, m.kind, key=lambda k: _KIND_RANK.get(k, 0)), {**(ck.tags or {}), **m.tags}
    conn.execute(update(checkpoints).where(checkpoints.c.id == ck.id).values(
        parts_registered=registered, state=state,
        committed_at=now if state == CKPT_COMMITTED and ck.state != CKPT_COMMITTED else ck.committed_at,
        total_bytes=ck.total_bytes + m.total_bytes, file_count=ck.file_count + len(m.files),
        kind=kind, milestone_marks=milestone_marks(kind, tags), metrics={**(ck.metrics or {}), **m.metrics}, tags=tags,
        writer_stall_seconds=max(stalls) if stalls else None))
    _audit_register(conn, m, ck.state, state, now=now, actor=actor)


def _parse_time(text: str) -> datetime | None:
    if not text:
        return None
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).astimezone(UTC)
