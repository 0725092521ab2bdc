"""The facts the retention rule (``core.retention``) decides from, read in bounded queries, and
the record of a retirement. The rule itself is not here: ``db/`` only fetches and records.

Reads, per 500 runs: the runs' committed and retired checkpoints with their verified replicas
(one query driven from ``(run_id, step)``), their pins, aliases and lineage children (one query
each per 500 checkpoints; two for children: the edges, and the origins recorded on run rows).
Nothing is read per checkpoint.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import and_, or_, select, update
from sqlalchemy.engine import Connection, Row

from core.errors import IllegalTransition, PruneRefused
from core.retention import CheckpointFacts, ReplicaFacts
from core.storage.content import SHARED_TIERS
from core.tiers import DURABLE_TIERS, Tier
from db.entities import CKPT_COMMITTED, CKPT_RETIRED as RETIRED, CKPT_SUPERSEDED, VERIFIED
from db.queries import _filter_only, _masks, newest_verified_steps
from db.rows import (
    add_audit,
    aliases,
    checkpoint_row,
    checkpoints,
    files,
    lineage,
    pins,
    replica_select,
    replicas,
    runs,
    tier_bit,
)

CHUNK = 500
DURABLE_BITS = sum(tier_bit(t) for t in DURABLE_TIERS)


def facts(conn: Connection, *, run_ids: Sequence[int] | None, node: str | None = None,
          contents: bool = False) -> list[CheckpointFacts]:
    """Every committed or retired checkpoint with a verified replica, of ``run_ids`` (None: of
    every run holding one; with ``node``: of the runs with a Tier 0 replica on that node). With
    ``contents`` (a budget on a tier that stores each content once counts by them), each copy on
    such a tier carries its files' (size, CRC32C): one more query per 500 checkpoints."""
    if run_ids is None:
        stmt = (select(checkpoints.c.run_id).distinct()
                .select_from(replicas.join(checkpoints, checkpoints.c.id == replicas.c.checkpoint_id))
                .where(replicas.c.state == VERIFIED))
        if node is not None:
            stmt = stmt.where(replicas.c.tier == Tier.NODE, replicas.c.node == node)
        run_ids = sorted(conn.execute(stmt).scalars())
    out: list[CheckpointFacts] = []
    for i in range(0, len(run_ids), CHUNK):
        out += _facts_of_runs(conn, run_ids[i:i + CHUNK], contents=contents)
    return out


def _facts_of_runs(conn: Connection, run_ids: Sequence[int], *, contents: bool) -> list[CheckpointFacts]:
    stmt = (replica_select()
            .add_columns(checkpoints.c.kind, checkpoints.c.metrics, checkpoints.c.tags, checkpoints.c.parts,
                         checkpoints.c.created_at.label("ckpt_created_at"),
                         checkpoints.c.committed_at.label("ckpt_committed_at"),
                         checkpoints.c.state.label("ckpt_state"), checkpoints.c.superseded_by)
            .where(checkpoints.c.run_id.in_(run_ids),
                   _filter_only(conn, checkpoints.c.state).in_([CKPT_COMMITTED, RETIRED, CKPT_SUPERSEDED]),
                   _filter_only(conn, replicas.c.state) == VERIFIED)
            .order_by(checkpoints.c.id, replicas.c.tier, replicas.c.part))
    rows = conn.execute(stmt).all()
    by_ckpt: dict[int, list[Row]] = defaultdict(list)
    for r in rows:
        by_ckpt[r.checkpoint_id].append(r)
    ids = sorted(by_ckpt)
    pinned: set[int] = set()
    named: dict[int, list[str]] = defaultdict(list)
    children: dict[int, set[str]] = defaultdict(set)
    held: dict[tuple[int, int], list[tuple[int, str]]] = defaultdict(list)
    for i in range(0, len(ids), CHUNK):
        chunk = ids[i:i + CHUNK]
        pinned |= set(conn.execute(select(pins.c.checkpoint_id).where(pins.c.checkpoint_id.in_(chunk))).scalars())
        for cid, name in conn.execute(select(aliases.c.checkpoint_id, aliases.c.name)
                                      .where(aliases.c.checkpoint_id.in_(chunk)).order_by(aliases.c.name)):
            named[cid].append(name)
        for cid, run in lineage_children(conn, chunk):
            children[cid].add(run)
        if contents:
            for cid, part, size, crc in conn.execute(select(files.c.checkpoint_id, files.c.part, files.c.size,
                                                            files.c.checksum).where(files.c.checkpoint_id.in_(chunk))):
                held[(cid, part)].append((size, crc))
    out = []
    for cid, rs in by_ckpt.items():
        r0 = rs[0]
        out.append(CheckpointFacts(
            run=r0.run_name, step=r0.step, parts=r0.parts, kind=r0.kind, tags=dict(r0.tags or {}),
            metrics=dict(r0.metrics or {}), created_at=r0.ckpt_created_at, committed_at=r0.ckpt_committed_at,
            state=r0.ckpt_state, attempt=r0.attempt, superseded_by=r0.superseded_by, pinned=cid in pinned,
            aliases=tuple(named[cid]), children=tuple(sorted(children[cid])),
            replicas=tuple(ReplicaFacts(replica_id=r.id, tier=r.tier, part=r.part, node=r.node, url=r.url,
                                        bytes=r.bytes, contents=tuple(sorted(held.get((cid, r.part), ())))
                                        if r.tier in SHARED_TIERS else ()) for r in rs)))
    return out


def lineage_children(conn: Connection, checkpoint_ids: Sequence[int]) -> list[tuple[int, str]]:
    """(parent checkpoint id, child run name) for each other run that comes from one of
    ``checkpoint_ids`` and is live: through a lineage edge from one of its checkpoints, or as
    the origin recorded on its run row (``runs.parent_run/parent_step``: a run registered with
    its origin protects it before its first checkpoint, and while that edge is pending). A run
    is live while it has no checkpoint yet or one that is not retired."""
    child, parent = checkpoints.alias("child"), checkpoints.alias("parent")
    live = (select(checkpoints.c.id).where(checkpoints.c.run_id == child.c.run_id,
                                           checkpoints.c.state != RETIRED).exists())
    stmt = (select(lineage.c.parent_id, runs.c.name).distinct()
            .select_from(lineage.join(child, child.c.id == lineage.c.child_id)
                         .join(parent, parent.c.id == lineage.c.parent_id)
                         .join(runs, runs.c.id == child.c.run_id))
            .where(lineage.c.parent_id.in_(checkpoint_ids), child.c.run_id != parent.c.run_id, live))
    found = {(cid, name) for cid, name in conn.execute(stmt)}
    origin_run, child_run = runs.alias("origin_run"), runs.alias("child_run")
    any_ckpt = select(checkpoints.c.id).where(checkpoints.c.run_id == child_run.c.id).exists()
    live_ckpt = select(checkpoints.c.id).where(checkpoints.c.run_id == child_run.c.id,
                                               checkpoints.c.state != RETIRED).exists()
    by_row = (select(parent.c.id, child_run.c.name)
              .select_from(parent.join(origin_run, origin_run.c.id == parent.c.run_id)
                           .join(child_run, and_(child_run.c.parent_run == origin_run.c.name,
                                                 child_run.c.parent_step == parent.c.step,
                                                 child_run.c.id != origin_run.c.id)))
              .where(parent.c.id.in_(checkpoint_ids), or_(~any_ckpt, live_ckpt)))
    found |= {(cid, name) for cid, name in conn.execute(by_row)}
    return sorted(found)


def retire(conn: Connection, run: str, step: int, *, reason: str, actor: str, now: datetime,
           keep_parents: bool = True, attempt: str | None = None) -> bool:
    """Record ``committed -> retired`` before any byte goes, after checking again, under the
    checkpoint's lock, what never lets a checkpoint be retired: a pin, an alias, being the
    newest verified checkpoint of its run, newer than its newest durable one or that one itself
    while a newer verified one is not durable, a child run
    (``keep_parents``). True if recorded now, False if it was retired already; ``PruneRefused``
    with the reason when the rows forbid it."""
    ck = checkpoint_row(conn, run, step, attempt=attempt, lock=True)
    if ck.state == RETIRED:
        return False
    if ck.state not in (CKPT_COMMITTED, CKPT_SUPERSEDED):
        raise IllegalTransition(f"checkpoint {run}/{step} is {ck.state!r}: only a committed or superseded "
                                "checkpoint is retired")
    refused = (_superseded_refusal if ck.state == CKPT_SUPERSEDED else _retire_refusal)(conn, ck, keep_parents)
    if refused:
        raise PruneRefused(f"checkpoint {run}/{step} not retired: {refused}")
    conn.execute(update(checkpoints).where(checkpoints.c.id == ck.id, checkpoints.c.state == ck.state)
                 .values(state=RETIRED))
    add_audit(conn, at=now, actor=actor, subject=f"checkpoint:{run}/{step}", action="retire",
              from_state=ck.state, to_state=RETIRED, reason=reason, run=run, step=step)
    return True


def _superseded_refusal(conn: Connection, ck: Row, keep_parents: bool) -> str | None:
    """What holds a superseded checkpoint: a pin, an alias, a child run, or a superseding attempt
    with no durable checkpoint yet."""
    if conn.execute(select(pins.c.checkpoint_id).where(pins.c.checkpoint_id == ck.id)).first():
        return "pinned"
    alias = conn.execute(select(aliases.c.name).where(aliases.c.checkpoint_id == ck.id)).scalar()
    if alias is not None:
        return f"alias {alias}"
    durable = conn.execute(select(checkpoints.c.id).where(
        checkpoints.c.run_id == ck.run_id, checkpoints.c.attempt == (ck.superseded_by or ""),
        checkpoints.c.state == CKPT_COMMITTED,
        checkpoints.c.verified_tiers.in_(_masks(lambda m: m & DURABLE_BITS))).limit(1)).first()
    if durable is None:
        return f"attempt {ck.superseded_by or '(unnamed)'} that superseded it has no durable checkpoint yet"
    if keep_parents:
        kids = lineage_children(conn, [ck.id])
        if kids:
            return f"parent of {kids[0][1]}"
    return None


def _retire_refusal(conn: Connection, ck: Row, keep_parents: bool) -> str | None:
    if conn.execute(select(pins.c.checkpoint_id).where(pins.c.checkpoint_id == ck.id)).first():
        return "pinned"
    alias = conn.execute(select(aliases.c.name).where(aliases.c.checkpoint_id == ck.id)).scalar()
    if alias is not None:
        return f"alias {alias}"
    if newest_verified_steps(conn, [ck.run_id]).get(ck.run_id) == ck.step:
        return "newest verified"
    durable = (select(checkpoints.c.step)
               .where(checkpoints.c.run_id == ck.run_id, checkpoints.c.state == CKPT_COMMITTED,
                      checkpoints.c.verified_tiers.in_(_masks(lambda m: m & DURABLE_BITS)))
               .order_by(checkpoints.c.step.desc()).limit(1))
    newest_durable = conn.execute(durable).scalar()
    if newest_durable is None or ck.step > newest_durable:
        return "newer than newest durable"
    if ck.step == newest_durable:  # and a newer verified one (checked above) is not durable yet
        return "newest durable"
    if keep_parents:
        kids = lineage_children(conn, [ck.id])
        if kids:
            return f"parent of {kids[0][1]}"
    return None


def retired_with_copies(conn: Connection, *, limit: int = 1000) -> list[tuple[str, int]]:
    """Retired checkpoints that still have a verified replica (an interrupted retirement)."""
    stmt = (select(runs.c.name, checkpoints.c.step).distinct()
            .select_from(checkpoints.join(runs, runs.c.id == checkpoints.c.run_id)
                         .join(replicas, and_(replicas.c.checkpoint_id == checkpoints.c.id,
                                              _filter_only(conn, replicas.c.state) == VERIFIED)))
            .where(checkpoints.c.state == RETIRED).order_by(runs.c.name, checkpoints.c.step).limit(limit))
    return [(n, s) for n, s in conn.execute(stmt)]
