"""Lineage edges between checkpoints and the recursive walks over them (queries 4 and 5).

An edge is child -> parent with a relation: ``follows`` (the previous checkpoint of the same
run, added automatically), ``resumed_from``, ``fine_tuned_from``, ``branched_from``. The graph
is kept acyclic: adding an edge whose parent already descends from the child raises
``LineageCycle``.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import and_, bindparam, delete, literal, select
from sqlalchemy.engine import Connection, Row

from core.errors import BadInput, LineageCycle
from db.entities import LineageEdge
from db.rows import checkpoints, insert_ignore, lineage, live_first, runs

FOLLOWS = "follows"
RELATIONS = frozenset({FOLLOWS, "resumed_from", "fine_tuned_from", "branched_from"})


def check_relation(relation: str) -> str:
    if relation not in RELATIONS:
        raise BadInput(f"unknown lineage relation {relation!r}; expected one of {sorted(RELATIONS)}")
    return relation


def ancestor_ids(conn: Connection, checkpoint_id: int) -> set[int]:
    """Every checkpoint reachable upwards from ``checkpoint_id`` (UNION, so it ends even on a
    graph that somehow holds a cycle)."""
    anc = select(lineage.c.parent_id.label("id")).where(lineage.c.child_id == checkpoint_id).cte(
        "anc", recursive=True)
    anc = anc.union(select(lineage.c.parent_id).join(anc, lineage.c.child_id == anc.c.id))
    return set(conn.execute(select(anc.c.id)).scalars())


def add_edge(conn: Connection, child_id: int, parent_id: int, relation: str, *, now: datetime,
             check_cycle: bool = True) -> bool:
    """Insert child -> parent (idempotent); True if the edge is new."""
    check_relation(relation)
    if check_cycle and conn.dialect.name == "postgresql":
        # Two edges added at once could each pass the check and close a cycle together; on
        # SQLite BEGIN IMMEDIATE already serialises writers, here one lock serialises the checks.
        conn.exec_driver_sql("SELECT pg_advisory_xact_lock(72717984)")
    if check_cycle and (child_id == parent_id or child_id in ancestor_ids(conn, parent_id)):
        raise LineageCycle(f"checkpoint {parent_id} already descends from checkpoint {child_id}; "
                           f"a {relation} edge would make a cycle")
    values = dict(child_id=child_id, parent_id=parent_id, relation=relation, created_at=now)
    return insert_ignore(conn, lineage, values, ["child_id", "parent_id"]) == 1


def link_into_run(conn: Connection, *, run: Row, checkpoint_id: int, step: int, now: datetime) -> None:
    """Give a new checkpoint its automatic edges: ``follows`` the previous checkpoint of its run,
    or, for the run's first checkpoint, the run's origin (``ensure_run(parent=...)``). A
    checkpoint registered out of order is spliced in: the next one now follows it."""
    prev, nxt = conn.execute(_NEIGHBOURS, dict(run_id=run.id, step=step)).one()
    origin = origin_id(conn, run, lock=True) if prev is None else None
    if prev is not None:
        add_edge(conn, checkpoint_id, prev, FOLLOWS, now=now, check_cycle=False)
    elif origin is not None:
        add_edge(conn, checkpoint_id, origin, run.parent_relation or "resumed_from", now=now)
    if nxt is not None:
        moved = lineage.c.child_id == nxt
        conn.execute(delete(lineage).where(moved, lineage.c.relation == FOLLOWS))
        if prev is None and origin is not None:
            conn.execute(delete(lineage).where(moved, lineage.c.parent_id == origin))
        add_edge(conn, nxt, checkpoint_id, FOLLOWS, now=now, check_cycle=False)


def _neighbours():
    # off the live chain: a superseded checkpoint, retired since or not (``superseded_at`` stays)
    same_run = and_(checkpoints.c.run_id == bindparam("run_id"), checkpoints.c.superseded_at.is_(None))
    prev = (select(checkpoints.c.id).where(same_run, checkpoints.c.step < bindparam("step"))
            .order_by(checkpoints.c.step.desc()).limit(1).scalar_subquery())
    nxt = (select(checkpoints.c.id).where(same_run, checkpoints.c.step > bindparam("step"))
           .order_by(checkpoints.c.step).limit(1).scalar_subquery())
    return select(prev, nxt)


_NEIGHBOURS = _neighbours()  # (previous, next) checkpoint of a run around a step; one round trip


def origin_id(conn: Connection, run: Row, *, lock: bool = False) -> int | None:
    """The checkpoint a run started from, if it is recorded. ``lock``: first lock the origin's
    run row, as registering a checkpoint of that run does, so that the origin registered at the
    same moment is either seen here or sees this checkpoint (``db.register._LINK_WAITING``)
    and the pending edge is never missed by both (PostgreSQL; SQLite serialises writers)."""
    if run.parent_run is None:
        return None
    if lock:
        conn.execute(select(runs.c.id).where(runs.c.name == run.parent_run).with_for_update())
    return conn.execute(
        select(checkpoints.c.id).join(runs, checkpoints.c.run_id == runs.c.id)
        .where(runs.c.name == run.parent_run, checkpoints.c.step == run.parent_step)
        .order_by(*live_first()).limit(1)).scalar()


def walk(conn: Connection, checkpoint_id: int, *, up: bool, max_depth: int) -> list[LineageEdge]:
    """Queries 4 (``up``: ancestors) and 5 (descendants): one recursive CTE, nearest first.
    A checkpoint reached by two paths is reported once, at its smallest depth."""
    near, far = (lineage.c.child_id, lineage.c.parent_id) if up else (lineage.c.parent_id, lineage.c.child_id)
    base = select(lineage.c.child_id, lineage.c.parent_id, lineage.c.relation,
                  literal(1).label("depth"), far.label("next_id")).where(near == checkpoint_id)
    cte = base.cte("walk", recursive=True)
    step_ = select(lineage.c.child_id, lineage.c.parent_id, lineage.c.relation, cte.c.depth + 1,
                   far).join(cte, near == cte.c.next_id).where(cte.c.depth < max_depth)
    cte = cte.union_all(step_)
    child, parent = checkpoints.alias("child"), checkpoints.alias("parent")
    child_run, parent_run = runs.alias("child_run"), runs.alias("parent_run")
    stmt = (
        select(child_run.c.name, child.c.step, parent_run.c.name, parent.c.step, cte.c.relation, cte.c.depth)
        .select_from(cte.join(child, child.c.id == cte.c.child_id)
                     .join(parent, parent.c.id == cte.c.parent_id)
                     .join(child_run, child_run.c.id == child.c.run_id)
                     .join(parent_run, parent_run.c.id == parent.c.run_id))
        .order_by(cte.c.depth, parent.c.step.desc(), child.c.step.desc())
    )
    seen: set[tuple] = set()
    edges: list[LineageEdge] = []
    for cr, cs, pr, ps, rel, depth in conn.execute(stmt):
        key = (cr, cs, pr, ps)
        if key not in seen:
            seen.add(key)
            edges.append(LineageEdge(cr, cs, pr, ps, rel, depth))
    return edges

