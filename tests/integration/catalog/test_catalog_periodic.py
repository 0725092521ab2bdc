"""Reads that reconcile makes on every pass, at a cost that must not grow with the catalog: the
archive backlog (milestones complete on Tier 1, not on Tier 2: the right checkpoints, read from
the marked ones only, also on a catalog upgraded from before the marks) and each run's newest
complete step (Tier 0 retention's guard). SQLite plans without statistics, so its plans are
checked here (EXPLAIN QUERY PLAN): an index the planner may pick on a small catalog is the one
it picks on a large one."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy import event

from core.settings import MilestonePolicy
from db import queries
from db.catalog import Catalog, upgrade
from db.rows import runs
from tests.kit.catalog import at_revision, manifest, verified


def _register(cat: Catalog, run: str, step: int, *, tags: dict | None = None, **kw):
    cat.ensure_run(run)
    return cat.register_part(dataclasses.replace(manifest(run, step, **kw), tags=tags or {}), actor="test")


def _plan(cat: Catalog, call) -> str:
    """SQLite's plan of the one statement ``call(connection)`` sends."""
    sent: list[tuple[str, tuple]] = []
    listener = lambda _c, _cur, stmt, params, *_a: sent.append((stmt, params))  # noqa: E731
    event.listen(cat.engine, "before_cursor_execute", listener)
    try:
        with cat.engine.connect() as conn:
            call(conn)
    finally:
        event.remove(cat.engine, "before_cursor_execute", listener)
    (stmt, params), = [s for s in sent if not s[0].startswith("BEGIN")]
    with cat.engine.connect() as conn:
        return " | ".join(r[-1] for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {stmt}", params))


def _backlog(cat: Catalog, **policy) -> list[int]:
    return [c.step for c in cat.milestone_backlog(MilestonePolicy(**policy))]


def test_backlog_is_the_marked_checkpoints_on_tier1_not_on_tier2(catalog):
    steps = {1: dict(kind="milestone"), 2: dict(kind="epoch"), 3: dict(tags={"milestone": "true"}),
             4: dict(tags={"milestone": "no"}), 5: {}, 6: dict(kind="milestone"), 8: {}}
    for step, kw in steps.items():
        verified(catalog, _register(catalog, "r", step, **kw).id, 1)
    verified(catalog, catalog.get_checkpoint("r", 6).id, 2)  # archived already
    _register(catalog, "r", 7, kind="milestone")  # not on Tier 1 yet
    # a two-part checkpoint tagged by its second part only
    catalog.register_part(manifest("r", 9, part=0, parts=2), actor="test")
    ck = catalog.register_part(dataclasses.replace(manifest("r", 9, part=1, parts=2), tags={"milestone": "yes"}),
                               actor="test")
    for part in (0, 1):
        verified(catalog, ck.id, 1, part=part)
    assert _backlog(catalog) == [1, 2, 3, 9]
    assert _backlog(catalog, tagged=False) == [2]
    assert _backlog(catalog, epoch_end=False) == [1, 3, 9]
    assert _backlog(catalog, tagged=False, epoch_end=False, every_steps=4) == [4, 8]
    assert _backlog(catalog, every_steps=4) == [1, 2, 3, 4, 8, 9]


def test_backlog_reads_only_the_marked_checkpoints_on_sqlite(sqlite_url):
    """The query must name the partial index's predicate and keep the state out of the index
    terms, or SQLite scans every checkpoint complete on Tier 1 (1M checkpoints: p95 371 ms)."""
    cat = Catalog.open(sqlite_url, auto_upgrade=True)
    try:
        verified(cat, _register(cat, "r", 10, kind="milestone").id, 1)
        plan = _plan(cat, lambda conn: queries.milestone_backlog(conn, MilestonePolicy()))
        assert "USING INDEX ix_checkpoints_milestone_backlog" in plan, plan
        assert "SCAN checkpoints" not in plan, plan
    finally:
        cat.close()


def test_newest_complete_step_per_run_walks_each_run_not_the_catalog(sqlite_url):
    """Tier 0 retention asks it for the runs on Tier 0 on every reconcile pass; it planned from
    the (state, verified_tiers) index, every complete checkpoint (1M: 15 s of a pass's SQL)."""
    cat = Catalog.open(sqlite_url, auto_upgrade=True)
    try:
        for run, step, tier in (("a", 10, 1), ("a", 20, 0), ("b", 10, 1), ("c", 5, 1)):
            verified(cat, _register(cat, run, step).id, tier)
        _register(cat, "a", 30)  # newer, on no tier yet
        with cat.engine.connect() as conn:
            ids = dict(conn.execute(sa.select(runs.c.id, runs.c.name).where(runs.c.name.in_(["a", "b"]))).all())
            assert {ids[i]: s for i, s in queries.newest_verified_steps(conn, list(ids)).items()} == {"a": 20, "b": 10}
        plan = _plan(cat, lambda conn: queries.newest_verified_steps(conn, list(ids)))
        assert "ix_checkpoints_state_verified_tiers" not in plan and "SCAN checkpoints" not in plan, plan
    finally:
        cat.close()


def test_upgrade_marks_the_milestones_of_an_existing_catalog(db_url):
    now = datetime(2026, 11, 30, tzinfo=UTC)
    with at_revision(db_url, "0005") as (conn, t):
        conn.execute(t["runs"].insert(), [dict(id=1, name="old", created_at=now, tags={})])
        rows = [(1, "milestone", {}), (2, "epoch", {}), (3, "step", {"milestone": "True"}),
                (4, "step", {"note": "no milestone here"}), (5, "step", {}), (6, "epoch", {"milestone": "1"})]
        conn.execute(t["checkpoints"].insert(), [dict(
            id=i, run_id=1, step=i, kind=kind, state="committed", format="safetensors", parts=1,
            parts_registered=1, total_bytes=1, file_count=0, metrics={}, tags=tags, created_at=now,
            committed_at=now, verified_tiers=2) for i, kind, tags in rows])
        conn.execute(t["checkpoint_files"].insert(), [dict(  # rows that reference the checkpoints
            id=i, checkpoint_id=i, part=0, path="model.safetensors", size=1, algorithm="crc32c",
            checksum="0badf00d") for i, _, _ in rows])
    upgrade(db_url)
    cat = Catalog(db_url)
    try:
        assert _backlog(cat) == [1, 2, 3, 6]
        assert _backlog(cat, epoch_end=False) == [1, 3, 6]
        assert _backlog(cat, tagged=False) == [2, 6]
    finally:
        cat.close()
