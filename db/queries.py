"""The catalog's read queries (numbered as in the catalog issue), as functions of a connection.

"Complete on tier t" means every part of the checkpoint has a ``verified`` replica on t; the
catalog keeps that as the bit mask ``checkpoints.verified_tiers`` (updated in the same
transaction as every replica state change), so queries 1, 2, 3 and 6 read a column and an
index instead of grouping replicas.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy import ColumnElement, Select, and_, func, or_, select, union_all
from sqlalchemy.engine import Connection, Row

from core.policy import MARK_EPOCH, MARK_TAGGED, is_milestone, marks_wanted
from core.tiers import Tier
from db.entities import (
    CKPT_COMMITTED,
    COPYING,
    CORRUPT,
    PENDING,
    PRUNED,
    PRUNING,
    VERIFIED,
    CheckpointInfo,
    FileInfo,
    Location,
    PromotionStatus,
    StoredCopy,
    TierUsage,
)
from db.rows import (
    ALL_TIERS,
    checkpoint_select,
    checkpoints,
    files,
    parts,
    replica_select,
    replicas,
    run_row,
    runs,
    tier_bit,
    to_checkpoint,
    to_file,
    to_replica,
)

if TYPE_CHECKING:
    from core.settings import MilestonePolicy


def complete_tiers(mask: int) -> list[int]:
    return [t for t in ALL_TIERS if mask & tier_bit(t)]


def _masks(pred: Callable[[int], object]) -> list[int]:
    return [m for m in range(1 << len(ALL_TIERS)) if pred(m)]


def _filter_only(conn: Connection, col: ColumnElement) -> ColumnElement:
    """``col`` as an expression no index can serve (``x + 0``, ``s || ''``: SQLite's documented
    way to disqualify a term), for a query that must be driven from another, selective index.

    Why: a SQLite catalog has no planner statistics (nothing runs ANALYZE), and without them
    SQLite takes an equality on any indexed column as selective. ``replicas.state = 'verified'``
    matches nearly every row, yet with ``ix_replicas_state_checked_at_id`` (migration 0003) the
    planner drove one run's prune candidates from it and walked every verified replica of the
    catalog instead of the run's checkpoints (docs/benchmarks.md has the cost at a million
    checkpoints). PostgreSQL plans from its statistics, and the expression would cost it them
    (an expression's selectivity is a guess, 0.5 %, so it drove the plan from a scan of every
    replica): there the column stays as it is."""
    if conn.dialect.name != "sqlite":
        return col
    return col + (0 if col.type.python_type is int else "")


def _has_tier(tiers: Iterable[int]) -> ColumnElement[bool]:
    want = sum(tier_bit(t) for t in tiers)
    return checkpoints.c.verified_tiers.in_(_masks(lambda m: m & want))


# --- (1) newest verified ------------------------------------------------------------------
def newest_verified(conn: Connection, run: str, *, tier: int | None, follow_resumed: bool,
                    durable_only: bool) -> CheckpointInfo | None:
    tiers = [tier] if tier is not None else [t for t in ALL_TIERS if not durable_only or t.durable]
    name, max_step, seen = run, None, set()
    while name is not None and name not in seen:
        seen.add(name)
        r = run_row(conn, name)
        stmt = checkpoint_select().where(checkpoints.c.run_id == r.id, checkpoints.c.state == CKPT_COMMITTED,
                                         _has_tier(tiers))
        if max_step is not None:
            stmt = stmt.where(checkpoints.c.step <= max_step)
        row = conn.execute(stmt.order_by(checkpoints.c.step.desc()).limit(1)).first()
        if row is not None:
            return to_checkpoint(row)
        if not follow_resumed or r.parent_relation != "resumed_from":
            return None
        name, max_step = r.parent_run, r.parent_step
        if not conn.execute(select(runs.c.id).where(runs.c.name == name)).first():
            return None  # a pending origin: its run is not in the catalog yet
    return None


def newest_verified_steps(conn: Connection, run_ids: Sequence[int] | None) -> dict[int, int]:
    """run id -> step of its newest checkpoint complete on any tier (the prune guard's 'newest').

    For given runs: each run's checkpoints walked newest first on ``(run_id, step)`` until the
    first complete one, a few index entries per run. (A ``GROUP BY run_id`` with ``run_id IN``
    planned, on SQLite without statistics, from the ``(state, verified_tiers)`` index: every
    complete checkpoint of the catalog, on every reconcile pass.)"""
    if run_ids is None:
        return dict(conn.execute(
            select(checkpoints.c.run_id, func.max(checkpoints.c.step))
            .where(checkpoints.c.state == CKPT_COMMITTED, checkpoints.c.verified_tiers != 0)
            .group_by(checkpoints.c.run_id)).all())
    newest = (select(checkpoints.c.step)
              .where(checkpoints.c.run_id == runs.c.id, _filter_only(conn, checkpoints.c.state) == CKPT_COMMITTED,
                     _filter_only(conn, checkpoints.c.verified_tiers) != 0)
              .order_by(checkpoints.c.step.desc()).limit(1).scalar_subquery())
    return {rid: step for rid, step in conn.execute(select(runs.c.id, newest).where(runs.c.id.in_(run_ids)))
            if step is not None}


# --- (2), (3) locations ------------------------------------------------------------------------
def locations(conn: Connection, ckpt: Row) -> list[Location]:
    tiers = complete_tiers(ckpt.verified_tiers)
    if not tiers:
        return []
    rows = conn.execute(
        select(replicas.c.tier, replicas.c.part, replicas.c.url, replicas.c.verified_at,
               func.coalesce(replicas.c.bytes, parts.c.bytes).label("bytes"))
        .select_from(replicas.outerjoin(parts, and_(parts.c.checkpoint_id == replicas.c.checkpoint_id,
                                                    parts.c.part == replicas.c.part)))
        .where(replicas.c.checkpoint_id == ckpt.id, replicas.c.state == VERIFIED, replicas.c.tier.in_(tiers))
        .order_by(replicas.c.tier, replicas.c.part)).all()
    by_tier: dict[int, list[Row]] = defaultdict(list)
    for r in rows:
        by_tier[r.tier].append(r)
    return [
        Location(run=ckpt.run_name, step=ckpt.step, tier=t, urls=tuple(r.url for r in rs),
                 verified_at=max(r.verified_at for r in rs), bytes=sum(r.bytes or 0 for r in rs))
        for t, rs in sorted(by_tier.items())
    ]


# --- a run's status page: bounded reads, whatever the run holds --------------------------------
def newest_checkpoints(conn: Connection, run_id: int, limit: int) -> list[CheckpointInfo]:
    """The run's ``limit`` checkpoints of highest step (any state), newest first: a walk down
    ``(run_id, step)``."""
    stmt = checkpoint_select().where(checkpoints.c.run_id == run_id).order_by(checkpoints.c.step.desc()).limit(limit)
    return [to_checkpoint(r) for r in conn.execute(stmt)]


def recorded_stalls(conn: Connection, run_id: int, limit: int) -> list[tuple[datetime, float]]:
    """(created_at, writer_stall_seconds) of the run's ``limit`` checkpoints of highest step
    that recorded a stall, newest first."""
    stmt = (select(checkpoints.c.created_at, checkpoints.c.writer_stall_seconds)
            .where(checkpoints.c.run_id == run_id, checkpoints.c.writer_stall_seconds.is_not(None))
            .order_by(checkpoints.c.step.desc()).limit(limit))
    return [(at, stall) for at, stall in conn.execute(stmt)]


def complete_at(conn: Connection, checkpoint_ids: Sequence[int], tier: int) -> dict[int, datetime]:
    """checkpoint id -> when the last of its parts was verified on ``tier`` (``locations``'
    ``verified_at``), for those of ``checkpoint_ids`` complete on ``tier``: one query."""
    stmt = (select(replicas.c.checkpoint_id, func.max(replicas.c.verified_at))
            .select_from(replicas.join(checkpoints, checkpoints.c.id == replicas.c.checkpoint_id))
            .where(replicas.c.checkpoint_id.in_(checkpoint_ids), replicas.c.tier == tier,
                   replicas.c.state == VERIFIED, _has_tier([tier]))
            .group_by(replicas.c.checkpoint_id))
    return {cid: at for cid, at in conn.execute(stmt) if at is not None}


# --- (6) under-replicated --------------------------------------------------------------------
def under_replicated(conn: Connection, *, durable_tier: int, min_copies: int, run_id: int | None,
                     limit: int | None) -> list[CheckpointInfo]:
    """Oldest registered first. The ids come from the (state, verified_tiers) index alone, then
    only the rows asked for (``limit``) are read: at 1M checkpoints with 20,000 under-replicated
    the first 100 cost one index walk, not 20,000 row reads and a sort."""
    durable = sum(tier_bit(t) for t in ALL_TIERS if t >= durable_tier)
    masks = _masks(lambda m: not (m & durable) or m.bit_count() < min_copies)
    ids = select(checkpoints.c.id).where(checkpoints.c.state == CKPT_COMMITTED, checkpoints.c.verified_tiers.in_(masks))
    if run_id is not None:
        ids = ids.where(checkpoints.c.run_id == run_id)
    ids = ids.order_by(checkpoints.c.id)
    if limit:
        ids = ids.limit(limit)
    stmt = checkpoint_select().where(checkpoints.c.id.in_(ids.scalar_subquery())).order_by(checkpoints.c.id)
    return [to_checkpoint(r) for r in conn.execute(stmt)]


# --- (9) usage, (10) unpromoted ----------------------------------------------------------------
def usage(conn: Connection, run_id: int | None) -> list[TierUsage]:
    stmt = (select(runs.c.name, replicas.c.tier, func.count(func.distinct(replicas.c.checkpoint_id)),
                   func.coalesce(func.sum(func.coalesce(replicas.c.bytes, parts.c.bytes)), 0))
            .select_from(replicas.join(checkpoints, checkpoints.c.id == replicas.c.checkpoint_id)
                         .join(runs, runs.c.id == checkpoints.c.run_id)
                         .outerjoin(parts, and_(parts.c.checkpoint_id == replicas.c.checkpoint_id,
                                                parts.c.part == replicas.c.part)))
            .where(replicas.c.state == VERIFIED)
            .group_by(runs.c.name, replicas.c.tier).order_by(runs.c.name, replicas.c.tier))
    if run_id is not None:
        stmt = stmt.where(checkpoints.c.run_id == run_id)
    return [TierUsage(run=n, tier=t, checkpoints=c, bytes=int(b)) for n, t, c, b in conn.execute(stmt)]


def _contents(tier: int, states: Sequence[str]) -> Select:
    """(size, checksum) of every file of ``tier``'s replicas in ``states``."""
    return (select(files.c.size, files.c.checksum)
            .select_from(files.join(replicas, and_(replicas.c.checkpoint_id == files.c.checkpoint_id,
                                                   replicas.c.part == files.c.part)))
            .where(replicas.c.tier == tier, replicas.c.state.in_(states)))


def stored_bytes(conn: Connection, *, shared: Collection[int], run_id: int | None = None) -> dict[int, int]:
    """tier -> the data bytes it holds (of ``run_id``'s checkpoints alone when given), in one
    statement: every file of a replica that has bytes there (copying, verified, pruning,
    corrupt); on a tier in ``shared`` each content (size, CRC32C: the content store's key) once,
    however many checkpoints link it."""
    held = [COPYING, VERIFIED, PRUNING, CORRUPT]
    joined = files.join(replicas, and_(replicas.c.checkpoint_id == files.c.checkpoint_id,
                                       replicas.c.part == files.c.part))
    where = [replicas.c.state.in_(held)]
    if run_id is not None:
        where.append(files.c.checkpoint_id.in_(select(checkpoints.c.id).where(checkpoints.c.run_id == run_id)))
    cols = (replicas.c.tier, files.c.size, files.c.checksum)
    once = select(*cols).select_from(joined).where(*where, replicas.c.tier.in_(list(shared))).distinct()
    each = select(*cols).select_from(joined).where(*where, replicas.c.tier.not_in(list(shared)))
    rows = union_all(once, each).subquery()
    stmt = select(rows.c.tier, func.coalesce(func.sum(rows.c.size), 0)).group_by(rows.c.tier)
    return {int(tier): int(n) for tier, n in conn.execute(stmt)}


def node_stored_bytes(conn: Connection, *, tier: int, run_id: int | None = None) -> dict[str, int]:
    """node -> the data bytes its copies on ``tier`` hold (a node-local tier: nothing shared),
    counted as ``stored_bytes`` counts them, in one statement."""
    joined = files.join(replicas, and_(replicas.c.checkpoint_id == files.c.checkpoint_id,
                                       replicas.c.part == files.c.part))
    where = [replicas.c.state.in_([COPYING, VERIFIED, PRUNING, CORRUPT]), replicas.c.tier == tier]
    if run_id is not None:
        where.append(files.c.checkpoint_id.in_(select(checkpoints.c.id).where(checkpoints.c.run_id == run_id)))
    stmt = (select(replicas.c.node, func.coalesce(func.sum(files.c.size), 0)).select_from(joined).where(*where)
            .group_by(replicas.c.node))
    return {str(node or ""): int(n) for node, n in conn.execute(stmt)}


def referenced_contents(conn: Connection, tier: int) -> set[tuple[int, str]]:
    """(size, checksum) of every file a replica on ``tier`` may reference: one to be copied or
    being copied, verified, being pruned, or corrupt (not yet deleted)."""
    stmt = _contents(tier, [PENDING, COPYING, VERIFIED, PRUNING, CORRUPT]).distinct()
    return {(int(size), checksum) for size, checksum in conn.execute(stmt)}


def unpromoted(conn: Connection, *, now: datetime, older_than_seconds: float, run_id: int | None,
               limit: int | None) -> list[CheckpointInfo]:
    """Committed checkpoints with a part that has no Tier 1 replica that is verified, was
    verified once (pruning/pruned: retention took it, it was promoted), or is being copied under
    a live lease."""
    promoted = (select(func.count()).select_from(replicas)
                .where(replicas.c.checkpoint_id == checkpoints.c.id, replicas.c.tier == Tier.SHARED,
                       or_(replicas.c.state.in_([VERIFIED, PRUNING, PRUNED]),
                           and_(replicas.c.state == COPYING, replicas.c.lease_expires_at > now)))
                .scalar_subquery())
    stmt = checkpoint_select().where(checkpoints.c.state == CKPT_COMMITTED,
                                     checkpoints.c.committed_at <= now - timedelta(seconds=older_than_seconds),
                                     promoted < checkpoints.c.parts)
    if run_id is not None:
        stmt = stmt.where(checkpoints.c.run_id == run_id)
    stmt = stmt.order_by(checkpoints.c.committed_at, checkpoints.c.id)
    return [to_checkpoint(r) for r in conn.execute(stmt.limit(limit) if limit else stmt)]


# --- reconcile: set-based reads -----------------------------------------------------------------
def promotion_status(conn: Connection, pairs: Sequence[tuple[str, int, str]], *, now: datetime,
                     older_than_seconds: float) -> dict[tuple[str, int, str], PromotionStatus]:
    """(run, step, attempt) -> its ``PromotionStatus``, for checkpoints the catalog knows. Three queries
    per 500 checkpoints (checkpoints, their parts, their Tier 1 replicas), whatever the catalog
    holds: "stale" is ``unpromoted``'s rule, computed on these rows only."""
    wanted = set(pairs)
    out: dict[tuple[str, int, str], PromotionStatus] = {}
    ordered = sorted(wanted)
    cutoff = now - timedelta(seconds=older_than_seconds)
    for i in range(0, len(ordered), 500):
        chunk = ordered[i:i + 500]
        names, steps = {r for r, _, _ in chunk}, {s for _, s, _ in chunk}
        rows = [r for r in conn.execute(
            select(checkpoints.c.id, runs.c.name, checkpoints.c.step, checkpoints.c.state, checkpoints.c.parts,
                   checkpoints.c.committed_at, checkpoints.c.attempt)
            .select_from(checkpoints.join(runs, runs.c.id == checkpoints.c.run_id))
            .where(runs.c.name.in_(names), checkpoints.c.step.in_(steps))) if (r.name, r.step, r.attempt) in wanted]
        ids = [r.id for r in rows]
        registered: dict[int, set[int]] = defaultdict(set)
        of_ids = parts.c.checkpoint_id.in_(ids)
        for cid, part in conn.execute(select(parts.c.checkpoint_id, parts.c.part).where(of_ids)):
            registered[cid].add(part)
        tier1: dict[int, dict[int, str]] = defaultdict(dict)
        promoted: dict[int, int] = defaultdict(int)
        for cid, part, state, lease in conn.execute(
                select(replicas.c.checkpoint_id, replicas.c.part, replicas.c.state, replicas.c.lease_expires_at)
                .where(replicas.c.checkpoint_id.in_(ids), replicas.c.tier == Tier.SHARED)):
            tier1[cid][part] = state
            promoted[cid] += state in (VERIFIED, PRUNING, PRUNED) or (state == COPYING and lease is not None
                                                                       and lease > now)
        for r in rows:
            stale = (r.state == CKPT_COMMITTED and r.committed_at is not None and r.committed_at <= cutoff
                     and promoted[r.id] < r.parts)
            out[(r.name, r.step, r.attempt)] = PromotionStatus(
                id=r.id, run=r.name, step=r.step, state=r.state, parts=r.parts,
                registered=frozenset(registered[r.id]), tier1=tier1[r.id], stale=stale)
    return out


def verified_page(conn: Connection, tier: int, *, after_id: int, limit: int, node: str | None) -> list[StoredCopy]:
    """The next ``limit`` verified replicas on ``tier`` after replica id ``after_id`` (keyset
    paging on ``ix_replicas_tier_state_id``), each with its part's files: two queries. ``node``:
    only replicas on that node or on none (Tier 0 of one machine)."""
    stmt = (replica_select().add_columns(checkpoints.c.parts.label("ckpt_parts"))
            .where(replicas.c.tier == tier, replicas.c.state == VERIFIED, replicas.c.id > after_id)
            .order_by(replicas.c.id).limit(limit))
    if node is not None:
        stmt = stmt.where(or_(replicas.c.node.is_(None), replicas.c.node == "", replicas.c.node == node))
    rows = conn.execute(stmt).all()
    by_part: dict[tuple[int, int], list[FileInfo]] = defaultdict(list)
    ids = sorted({r.checkpoint_id for r in rows})
    for i in range(0, len(ids), 500):
        for f in conn.execute(select(files).where(files.c.checkpoint_id.in_(ids[i:i + 500]))
                              .order_by(files.c.checkpoint_id, files.c.part, files.c.path)):
            by_part[(f.checkpoint_id, f.part)].append(to_file(f))
    return [StoredCopy(replica=to_replica(r), parts=r.ckpt_parts, files=tuple(by_part[(r.checkpoint_id, r.part)]))
            for r in rows]


def milestone_backlog(conn: Connection, policy: MilestonePolicy) -> list[CheckpointInfo]:
    """Committed checkpoints complete on Tier 1 and not on Tier 2 that ``policy`` calls
    milestones, oldest registered first. The marked ones (tagged, epoch ends) come from the
    partial index on ``(milestone_marks, verified_tiers)`` (migration 0006): a read of the marked
    checkpoints not yet archived, whatever the catalog holds. The every-K-steps rule marks
    nothing (it is the policy's, not the checkpoint's): with it set, its term still tests every
    checkpoint complete on Tier 1 and not on Tier 2 (bounded in practice by Tier 1 retention)."""
    masks = _masks(lambda m: m & tier_bit(Tier.SHARED) and not m & tier_bit(Tier.OBJECT))
    wanted = [m for m in range(1, (MARK_TAGGED | MARK_EPOCH) + 1) if m & marks_wanted(policy)]
    terms: list[ColumnElement[bool]] = []
    if wanted:
        # the index's own predicate, repeated (SQLite uses a partial index only if the query
        # says it), and the state kept out of the index terms on SQLite (``_filter_only``), or,
        # without statistics, it prefers the (state, verified_tiers) index: every checkpoint
        # complete on Tier 1
        terms.append(and_(checkpoints.c.milestone_marks > 0, checkpoints.c.milestone_marks.in_(wanted),
                          _filter_only(conn, checkpoints.c.state) == CKPT_COMMITTED))
    if policy.every_steps:
        terms.append(and_(checkpoints.c.state == CKPT_COMMITTED, checkpoints.c.step % policy.every_steps == 0))
    found: dict[int, CheckpointInfo] = {}
    for term in terms:  # one query per term: an OR of both would be one scan
        stmt = checkpoint_select().where(checkpoints.c.verified_tiers.in_(masks), term)
        found |= {c.id: c for c in map(to_checkpoint, conn.execute(stmt))}
    return [found[i] for i in sorted(found) if is_milestone(found[i].kind, found[i].step, found[i].tags, policy)]
