"""Attempts in the catalog: a checkpoint is the parts of one training attempt. The two-rank
crash of the recovery page: both ranks killed after step 37, node-1's Tier 0 wiped, both resume
from 20 and re-save 25..35 with other bytes. Never a checkpoint made of two attempts, never a
superseded step offered, and a run name reused by mistake never supersedes a history."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from core.errors import ConflictError
from db.entities import CKPT_COMMITTED, CKPT_PARTIAL, CKPT_SUPERSEDED
from tests.kit.catalog import manifest, verified

RUN = "llm"


def _save(cat, step, part, attempt, *, created: datetime | None = None, **kw):
    m = manifest(RUN, step, part=part, parts=2, attempt=attempt, **kw)
    if created is not None:
        m = replace(m, created_at=created.isoformat())
    return cat.register_part(m, actor="test")


def _durable(cat, ck):
    for part in range(ck.parts):
        verified(cat, ck.id, 1, part)


def _first_attempt(cat):
    """Attempt A saved 5..20 whole (durable) and 25..35 on rank 0 only (rank 1's node lost)."""
    cat.ensure_run(RUN)
    cat.record_resume(RUN, "A", None, actor="rank0")
    for step in (5, 10, 15, 20):
        _save(cat, step, 0, "A")
        _durable(cat, _save(cat, step, 1, "A"))
    for step in (25, 30, 35):
        _save(cat, step, 0, "A")


def test_a_resumed_attempt_never_completes_an_older_attempts_step(catalog):
    _first_attempt(catalog)
    assert catalog.record_resume(RUN, "B", 20, actor="rank0") == [25, 30, 35]
    assert catalog.record_resume(RUN, "B", 20, actor="rank1") == []  # the other rank: nothing more
    for step in (25, 30, 35):
        ck = _save(catalog, step, 1, "B")  # rank 1 re-saves first: a new checkpoint, not A's
        assert (ck.attempt, ck.state, ck.parts_registered) == ("B", CKPT_PARTIAL, 1)
        old = catalog.get_checkpoint(RUN, step, "A")
        assert (old.state, old.superseded_by, old.parts_registered) == (CKPT_SUPERSEDED, "B", 1)
    ck = _save(catalog, 25, 0, "B", salt="other bytes")  # rank 0 re-saves 25 with other bytes: no conflict
    assert (ck.state, ck.parts_registered) == (CKPT_COMMITTED, 2)
    assert catalog.get_checkpoint(RUN, 25).attempt == "B"  # the live one by default
    newest = catalog.newest_verified(RUN)
    assert (newest.step, newest.attempt) == (20, "A")  # B/25 not durable yet; A/35 never offered
    _durable(catalog, ck)
    assert (catalog.newest_verified(RUN).step, catalog.newest_verified(RUN).attempt) == (25, "B")
    actions = [e.action for e in catalog.history(RUN, 30)]
    assert "supersede" in actions


def test_a_late_part_of_an_older_attempt_is_recorded_superseded(catalog):
    _first_attempt(catalog)
    catalog.record_resume(RUN, "B", 20, actor="rank0")
    late = _save(catalog, 40, 0, "A")  # A's rank 0 got further than anyone knew: found late by reconcile
    assert (late.state, late.superseded_by) == (CKPT_SUPERSEDED, "B")
    late1 = _save(catalog, 40, 1, "A")
    assert late1.state == CKPT_SUPERSEDED  # both parts, yet never committed nor offered
    assert catalog.newest_verified(RUN).step == 20
    b40 = _save(catalog, 40, 1, "B")
    assert (b40.attempt, b40.state) == ("B", CKPT_PARTIAL)


def test_resume_recorded_after_the_new_attempts_first_part_still_supersedes(catalog):
    _first_attempt(catalog)
    catalog.record_resume(RUN, "B", 20, actor="rank1")
    _save(catalog, 25, 1, "B")
    catalog.record_resume(RUN, "B", 20, actor="rank0")  # rank 0's resume call comes second
    assert catalog.get_checkpoint(RUN, 25, "B").state == CKPT_PARTIAL
    assert catalog.get_checkpoint(RUN, 25, "A").state == CKPT_SUPERSEDED


def test_a_run_name_reused_by_mistake_is_refused_not_superseding(catalog):
    _first_attempt(catalog)
    with pytest.raises(ConflictError, match="reused by mistake"):
        _save(catalog, 10, 0, "C")  # a new job under the same name that never resumed
    assert catalog.get_checkpoint(RUN, 10).attempt == "A"
    assert catalog.get_checkpoint(RUN, 10).state == CKPT_COMMITTED
    assert catalog.newest_verified(RUN).step == 20


def test_a_resume_from_scratch_supersedes_what_no_one_completed(catalog):
    catalog.ensure_run(RUN)
    _save(catalog, 5, 0, "A")  # part 1 of step 5 never came
    catalog.record_resume(RUN, "B", None, actor="rank0")
    assert catalog.get_checkpoint(RUN, 5, "A").state == CKPT_SUPERSEDED
    _save(catalog, 5, 0, "B")
    assert _save(catalog, 5, 1, "B").state == CKPT_COMMITTED


def test_the_unnamed_attempt_keeps_its_rules(catalog):
    catalog.ensure_run(RUN)
    _save(catalog, 5, 0, "")
    with pytest.raises(ConflictError, match="different manifest"):
        _save(catalog, 5, 0, "", salt="x")


def test_the_new_attempts_chain_skips_superseded_checkpoints_retired_since(catalog):
    """B's next checkpoint follows B's own newest, never an older attempt's step above where B
    resumed, superseded and then retired (its row keeps ``superseded_at``)."""
    _first_attempt(catalog)
    catalog.record_resume(RUN, "B", 20, actor="rank0")
    _save(catalog, 25, 0, "B")
    _durable(catalog, _save(catalog, 25, 1, "B"))
    for step in (25, 30, 35):
        verified(catalog, catalog.get_checkpoint(RUN, step, "A").id, 0, 0)
        assert catalog.retire(RUN, step, attempt="A", reason="superseded by attempt B", actor="test")
    _save(catalog, 40, 0, "B")
    assert [(e.parent_step, e.relation) for e in catalog.ancestors(RUN, 40, max_depth=1)] == [(25, "follows")]
    assert [(e.parent_step, e.relation) for e in catalog.ancestors(RUN, 25, max_depth=1)] == [(20, "follows")]


def test_a_launch_heard_of_only_after_its_relaunch_resumed_is_the_older_one(catalog):
    """Launch A saved 5..35 on both nodes while no agent could reach the catalog; launch B
    resumed from scratch (the catalog knew nothing) and made 5 and 10 durable. Then the agents
    come back and register A's folders: the catalog hears of A second, yet A is the older launch
    (its manifests were written before B resumed), so every step of it is history."""
    catalog.ensure_run(RUN)
    before = datetime.now(UTC) - timedelta(hours=1)
    catalog.record_resume(RUN, "B", None, actor="rank0")
    for step in (5, 10):
        _save(catalog, step, 0, "B")
        _durable(catalog, _save(catalog, step, 1, "B"))
    for step in (10, 35):
        for part in (0, 1):
            late = _save(catalog, step, part, "A", created=before)
            assert (late.state, late.superseded_by) == (CKPT_SUPERSEDED, "B")
        _durable(catalog, catalog.get_checkpoint(RUN, step, "A"))
    newest = catalog.newest_verified(RUN)
    assert (newest.step, newest.attempt) == (10, "B")
    assert catalog.get_checkpoint(RUN, 10).attempt == "B"


def test_a_reused_run_name_never_becomes_the_newest_whatever_step_it_saves(catalog):
    _first_attempt(catalog)
    for step in (10, 45):  # one step A holds, one above anything A saved
        with pytest.raises(ConflictError, match=r"never resumed.*reused by mistake"):
            _save(catalog, step, 0, "C", created=datetime.now(UTC))
    newest = catalog.newest_verified(RUN)
    assert (newest.step, newest.attempt) == (20, "A")
    assert [ck.step for ck in catalog.list_checkpoints(RUN) if ck.attempt == "C"] == []


def test_a_late_launch_whose_clock_runs_ahead_is_refused_never_live(catalog):
    """The older launch's node clock was an hour fast: its manifests seem written after the
    relaunch resumed. The catalog cannot tell it from a reused name, so it refuses it; it is
    never joined to, or put above, the relaunch's history."""
    catalog.ensure_run(RUN)
    catalog.record_resume(RUN, "B", None, actor="rank0")
    _durable(catalog, _save(catalog, 5, 0, "B") and _save(catalog, 5, 1, "B"))
    with pytest.raises(ConflictError, match="never resumed"):
        _save(catalog, 35, 0, "A", created=datetime.now(UTC) + timedelta(hours=1))
    assert catalog.newest_verified(RUN).attempt == "B"


@pytest.mark.parametrize("written", ["after the resume (a clock ahead)", "unknown"])
def test_a_launch_that_never_resumed_is_never_live_beside_one_that_resumed(catalog, written):
    """B resumed from scratch and has saved nothing yet; a part of A, which never resumed, comes
    with a manifest that seems written after B's resume (or says nothing of when): A is either
    an older launch whose clock runs ahead or a reused name. Either way it is never live."""
    from core.errors import ReusedRunName

    catalog.ensure_run(RUN)
    catalog.record_resume(RUN, "B", None, actor="rank0")
    created = datetime.now(UTC) + timedelta(minutes=5) if written.startswith("after") else None
    with pytest.raises(ReusedRunName, match="never resumed"):
        _save(catalog, 900, 0, "A", created=created)
    _durable(catalog, _save(catalog, 100, 0, "B") and _save(catalog, 100, 1, "B"))
    assert (catalog.newest_verified(RUN).step, catalog.newest_verified(RUN).attempt) == (100, "B")


def test_a_launch_that_never_resumed_is_refused_beside_checkpoints_saved_before_attempts(catalog):
    """Checkpoints bulk-imported (``register_many``'s one INSERT per table, which records their
    attempt's row too) are a history: a named launch that never resumed is refused above them."""
    from core.errors import ReusedRunName

    catalog.ensure_run(RUN)
    catalog.register_many([manifest(RUN, step) for step in (10, 20, 30)], actor="import")
    with pytest.raises(ReusedRunName, match="history of attempt \\(unnamed\\)"):
        catalog.register_part(manifest(RUN, 40, attempt="slurm-9-r0"), actor="test")
    assert catalog.get_checkpoint(RUN, 30).attempt == ""
    assert [ck.step for ck in catalog.list_checkpoints(RUN)] == [10, 20, 30]
